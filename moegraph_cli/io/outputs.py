"""Where moegraph writes: output paths checked before any work, every file written atomically.

Checks (`check_output_file`, `check_output_dir`) run before a command does anything slow: an
output path of the wrong kind (a directory where a file goes, a file where a directory goes),
a missing parent directory, a path the system refuses (too long) and a directory that takes no
new files (read-only, not ours, /proc or /sys: a file is created there and removed again to
know) are usage errors naming the path and the flag. A missing parent is created only when
the user passed --mkdir; the writers below then create it. A write that fails later (a full
disk) raises its OSError with the target's path as its filename, for the CLI's one line.

`write_atomically` writes a temporary file beside the target, `.NAME.XXXXXXXX.tmp`, and
renames it over the target (os.replace), so an interrupted write leaves the old file or none,
never half of one: the temporary file is removed on any failure, Ctrl-C and the signals
commands/cli_signals.py raises included (its name is held before the file exists, so the
cleanup knows it whenever the interruption comes). Only a process killed outright (kill -9, the OOM
killer) leaves one; `leftover_temporaries` finds them. The result gets the permissions a plain
open() would give (0o666 less the umask), whichever library wrote the bytes: safetensors, for
one, creates its files 0o600.

Within `removed_on_interrupt()` (every CLI command runs in one) the files the writers here
create where none was, and the directories they create, are listed; a block that ends by an
interruption (Ctrl-C, SIGTERM, SIGHUP) removes them again, so an interrupted command leaves
no output of its own. A file it replaced keeps its new, whole content (the old one is gone
either way). A command that fails on an error keeps the outputs it had written whole (a plan
written before stdout turned out full is still a good plan).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import threading
from pathlib import Path
from typing import Callable

from ..errors import UsageError, show_path

_umask_lock = threading.Lock()
# A temporary file of write_atomically (or of an older moegraph's tempfile.mkstemp): the
# target's name, then 8 random characters.
_TEMPORARY = re.compile(r"\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp")
_journals: list[list[Path]] = []  # what the writers created, per removed_on_interrupt()


def leftover_target(name: str) -> str | None:
    """The target a temporary file named `name` was written for, or None if it is not one."""
    m = _TEMPORARY.fullmatch(name)
    return m.group("target") if m else None


def leftover_temporaries(directory: Path) -> list[Path]:
    """The temporary files of writes in `directory` that did not finish (sorted): those of a
    killed process, or of a write still under way in another."""
    return sorted(p for p in Path(directory).iterdir() if leftover_target(p.name) is not None)


def _temporary_name(directory: Path, name: str) -> Path:
    return directory / f".{name}.{secrets.token_hex(4)}.tmp"


def _new_file(path: Path) -> bool:
    """Create `path`, empty and 0o600, unless something is there already: True if created.
    The caller holds the path before the file exists, so its cleanup never misses one."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    return True


def _discard(path: Path | None) -> None:
    if path is None:
        return
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _record(path: Path) -> None:
    """List `path`, about to be created, in the innermost open removed_on_interrupt()."""
    if _journals:
        _journals[-1].append(path)


@contextlib.contextmanager
def removed_on_interrupt():
    """The files and directories the writers here create inside the block are removed again
    if it ends by a KeyboardInterrupt (errors.Interrupted among them); see the module
    docstring."""
    created: list[Path] = []
    _journals.append(created)
    try:
        yield
    except KeyboardInterrupt:
        for path in created:
            if not path.is_dir():
                _discard(path)
        for directory in sorted((p for p in created if p.is_dir()),
                                key=lambda p: len(p.parts), reverse=True):
            try:
                directory.rmdir()  # only if nothing else appeared in it
            except OSError:
                pass
        raise
    finally:
        _journals.remove(created)


def _make_parents(directory: Path) -> None:
    missing = [p for p in (directory, *directory.parents) if not p.exists()]
    for parent in missing:
        _record(parent)
    directory.mkdir(parents=True, exist_ok=True)


def _parent_ok(path: Path, flag: str, mkdir: bool) -> None:
    parent = path.parent
    if parent.is_dir():
        _takes_files(parent, path, flag)
        return
    existing = next((p for p in parent.parents if p.exists()), None)
    if parent.exists() or (existing is not None and not existing.is_dir()):
        blocker = parent if parent.exists() else existing
        raise UsageError(f"{flag} {path}: {blocker} is not a directory")
    if not mkdir:
        raise UsageError(f"{flag} {path}: directory {parent} does not exist (add --mkdir to "
                         "create it)")
    if existing is not None:
        _takes_files(existing, path, flag)


def _takes_files(directory: Path, path: Path, flag: str) -> None:
    """A file can be created in `directory` (the writers put a temporary file beside the
    target): one is created and removed again. A read-only file system, a directory that is
    not writable and /proc or /sys fail here, before any work."""
    probe = _temporary_name(directory, "moegraph-probe")
    try:
        while not _new_file(probe):
            probe = _temporary_name(directory, "moegraph-probe")
    except OSError as e:
        raise UsageError(f"{flag} {show_path(path)}: cannot create files in {directory} "
                         f"({e.strerror or type(e).__name__})") from None
    finally:
        _discard(probe)


def _name_lengths_ok(path: Path, flag: str) -> None:
    """No part of `path` is longer than the file system allows (NAME_MAX, usually 255
    bytes), nor the whole path (PATH_MAX, 4096): checked up front, since the directories
    --mkdir would create do not exist yet to be refused."""
    try:
        base = next(p for p in (path, *path.parents) if p.exists())
        name_max, path_max = os.pathconf(base, "PC_NAME_MAX"), os.pathconf(base, "PC_PATH_MAX")
    except (OSError, StopIteration, ValueError):
        name_max, path_max = 255, 4096
    long = next((part for part in path.parts if len(os.fsencode(part)) > name_max), None)
    if long is not None:
        raise UsageError(f"{flag} {show_path(path)}: File name too long (a name of "
                         f"{len(os.fsencode(long))} bytes; at most {name_max})")
    if len(os.fsencode(str(path.absolute()))) >= path_max:
        raise UsageError(f"{flag} {show_path(path)}: File name too long (the path has "
                         f"{len(os.fsencode(str(path.absolute())))} bytes; at most "
                         f"{path_max - 1})")


def _checked(flag: str, path: Path, check) -> None:
    """Run `check`; an OSError from looking at the path (too long, a loop) names the flag."""
    try:
        _name_lengths_ok(path, flag)
        check()
    except OSError as e:
        raise UsageError(f"{flag} {show_path(path)}: {e.strerror or type(e).__name__}"
                         ) from None


def check_output_file(path: str | os.PathLike | None, flag: str, mkdir: bool = False) -> None:
    """`path` may be written as a file: not a directory, and its parent exists (or --mkdir)
    and takes new files."""
    if path is None:
        return
    path = Path(path)

    def check():
        if path.is_dir():
            raise UsageError(f"{flag} {path} is a directory; give a file name")
        if path.exists() and not path.is_file():
            raise UsageError(f"{flag} {path} exists and is not a regular file")
        _parent_ok(path, flag, mkdir)

    _checked(flag, path, check)


def check_output_dir(path: str | os.PathLike, flag: str, mkdir: bool = False) -> None:
    """`path` may be used as an output directory: not a file, and its parent exists (or
    --mkdir); the directory it is or will be in takes new files."""
    path = Path(path)

    def check():
        if path.exists() and not path.is_dir():
            raise UsageError(f"{flag} {path} is a file, not a directory")
        if path.is_dir():
            _takes_files(path, path, flag)
        else:
            _parent_ok(path, flag, mkdir)

    _checked(flag, path, check)


def file_mode() -> int:
    """The mode open() gives a new file: 0o666 less the process umask."""
    with _umask_lock:  # os.umask can only be read by setting it
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a temporary file in `path`'s directory, which then replaces `path` in
    one rename. Creates missing parent directories (callers from the CLI checked that the user
    asked for them). On any failure, KeyboardInterrupt included, the temporary file is removed
    and `path` is untouched."""
    path = Path(path)
    tmp = None
    try:
        _make_parents(path.parent)
        if not path.exists():
            _record(path)
        tmp = _temporary_name(path.parent, path.name)
        while not _new_file(tmp):
            tmp = _temporary_name(path.parent, path.name)
        write(tmp)
        os.chmod(tmp, file_mode())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        _discard(tmp)
        raise _about(e, path) from None
    except BaseException:
        _discard(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _about(e: OSError, path: Path) -> OSError:
    """`e` (same type and errno) naming the target, not the temporary file beside it."""
    if e.filename is None or ".tmp" in str(e.filename) or e.filename == str(path.parent):
        e.filename, e.filename2 = str(path), None
    return e


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    return write_atomically(path, lambda tmp: tmp.write_text(text))
