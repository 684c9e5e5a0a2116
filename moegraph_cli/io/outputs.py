"""Where moegraph writes: output paths checked before any work, every file written atomically.

Checks (`check_output_file`, `check_output_dir`) run before a command does anything slow: an
output path of the wrong kind (a directory where a file goes, a file where a directory goes),
a missing parent directory, a path the system refuses (too long) and a directory that takes no
new files (read-only, not ours, /proc or /sys: a file is created there and removed again to
know) are usage errors naming the path and the flag. A missing parent is created only when
the user passed --mkdir; the writers below then create it. A write that fails later (a full
disk) raises its OSError with the target's path as its filename, for the CLI's one line.

`write_atomically` writes a temporary file beside the target and renames it over the target
(os.replace), so an interrupted write leaves the old file or none, never half of one. The
result gets the permissions a plain open() would give (0o666 less the umask), whichever
library wrote the bytes: safetensors, for one, creates its files 0o600.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Callable

from ..errors import UsageError, show_path

_umask_lock = threading.Lock()


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
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".moegraph-probe.")
    except OSError as e:
        raise UsageError(f"{flag} {show_path(path)}: cannot create files in {directory} "
                         f"({e.strerror or type(e).__name__})") from None
    os.close(fd)
    os.unlink(probe)


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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise _about(e, path) from None
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _about(e, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
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
