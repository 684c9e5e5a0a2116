"""Where moegraph writes: output paths checked before any work, every file written atomically.

Checks (`check_output_file`, `check_output_dir`) run before a command does anything slow: an
output path of the wrong kind (a directory where a file goes, a file where a directory goes)
and a missing parent directory are usage errors naming the path and the flag. A missing parent
is created only when the user passed --mkdir; the writers below then create it.

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

from ..errors import UsageError

_umask_lock = threading.Lock()


def _parent_ok(path: Path, flag: str, mkdir: bool) -> None:
    parent = path.parent
    if parent.is_dir():
        return
    existing = next((p for p in parent.parents if p.exists()), None)
    if parent.exists() or (existing is not None and not existing.is_dir()):
        blocker = parent if parent.exists() else existing
        raise UsageError(f"{flag} {path}: {blocker} is not a directory")
    if not mkdir:
        raise UsageError(f"{flag} {path}: directory {parent} does not exist (add --mkdir to "
                         "create it)")


def check_output_file(path: str | os.PathLike | None, flag: str, mkdir: bool = False) -> None:
    """`path` may be written as a file: not a directory, and its parent exists (or --mkdir)."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name")
    if path.exists() and not path.is_file():
        raise UsageError(f"{flag} {path} exists and is not a regular file")
    _parent_ok(path, flag, mkdir)


def check_output_dir(path: str | os.PathLike, flag: str, mkdir: bool = False) -> None:
    """`path` may be used as an output directory: not a file, and its parent exists (or
    --mkdir)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path} is a file, not a directory")
    if not path.exists():
        _parent_ok(path, flag, mkdir)


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
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    return write_atomically(path, lambda tmp: tmp.write_text(text))
