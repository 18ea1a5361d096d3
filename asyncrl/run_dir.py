"""Writing a run directory's files whole: what a full disk or a directory turned read-only may leave behind.

Invariants:
- A write is all or nothing: ``append`` writes its bytes at the end of the file (looping over short writes) and,
  when the operating system refuses part-way (``ENOSPC``, ``EROFS``, ``EACCES``, ``EDQUOT``, ...), cuts the file back
  to where the write began, so a file written in whole rows ends with a whole row.
- The failure is one ``RunDirError`` (an ``OSError``, its ``errno`` kept) whose message is one line naming the file
  and the error; ``asyncrl run`` prints it and stops at a safe point (``asyncrl/cli.py``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


class RunDirError(OSError):
    """A file of a run directory (or a checkpoint in it) that could not be written: one line naming the file and the
    operating system's error."""

    def __init__(self, path: str | Path, exc: OSError):
        super().__init__(exc.errno, exc.strerror or str(exc), str(path))
        code = errno.errorcode.get(exc.errno or 0)
        self.message = f"cannot write {str(path)!r}: {exc.strerror or exc}" + (f" ({code})" if code else "")

    def __str__(self) -> str:
        return self.message


def append(fd: int, data: bytes, path: str | Path) -> None:
    """Write all of ``data`` at the end of the file open as ``fd``, or none of it (``RunDirError``)."""
    start = os.lseek(fd, 0, os.SEEK_END)
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        try:  # a full disk still lets a file shrink; a read-only one may not, and then the reader's rule holds
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise RunDirError(path, exc) from None


def replace(path: Path, data: bytes) -> None:
    """``path`` now holds ``data``, or still what it held (written beside it, then renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = open_for_append(tmp)
        try:
            append(fd, data, path)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise exc if isinstance(exc, RunDirError) else RunDirError(path, exc) from None


def open_for_append(path: Path, truncate: bool = True) -> int:
    """A descriptor to ``append`` to ``path`` (created; emptied when ``truncate``), or ``RunDirError``."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else os.O_APPEND), 0o644)
    except OSError as exc:
        raise RunDirError(path, exc) from None
