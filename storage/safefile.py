"""Opening files named by untrusted input: regular files only, inside a directory, size-capped.

Used by bundle import. A member name must be one plain path component; the
file is ``lstat``ed before it is opened (a symlink, FIFO, socket or device is
refused without ever being opened, so a FIFO cannot hang the caller), then
opened with ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat``ed again, so a file
swapped in between is caught too. Sizes are checked before any byte is read.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from .errors import BundleError

#: A bundle member name: one path component, no leading dot.
MEMBER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def member_path(base: Path, name: object, what: str) -> Path:
    """``base / name`` for a member name from untrusted input; refuses anything that could leave ``base``.

    Raises:
        BundleError: ``name`` is not a single plain path component.
    """
    if not isinstance(name, str) or not MEMBER_NAME.fullmatch(name) or name in (".", ".."):
        raise BundleError(f"{what} {name!r} is not a plain file name inside the bundle "
                          "(paths, '..' and absolute names are refused)")
    return base / name


def open_regular(path: Path, max_bytes: int, what: str) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only if it is a regular file of at most ``max_bytes``; return (fd, stat).

    Never follows a symlink and never opens a FIFO or device. The caller closes the fd.

    Raises:
        BundleError: missing, not a regular file, or over ``max_bytes``.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise BundleError(f"{what} {path.name} is missing from the bundle") from None
    except OSError as e:
        raise BundleError(f"cannot inspect {what} {path.name}: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise BundleError(f"{what} {path.name} is {_kind(st.st_mode)}; only regular files are read from a bundle")
    _check_size(st.st_size, max_bytes, what, path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise BundleError(f"cannot open {what} {path.name}: {e.strerror or e}") from e
    try:
        st2 = os.fstat(fd)
        if not stat.S_ISREG(st2.st_mode) or (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
            raise BundleError(f"{what} {path.name} changed while it was being opened")
        _check_size(st2.st_size, max_bytes, what, path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st2


def read_regular(path: Path, max_bytes: int, what: str) -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` (see :func:`open_regular`)."""
    fd, st = open_regular(path, max_bytes, what)
    try:
        chunks = []
        left = st.st_size + 1  # one more, to notice a file that grew
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    except OSError as e:
        raise BundleError(f"cannot read {what} {path.name}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) != st.st_size:
        raise BundleError(f"{what} {path.name} changed size while it was read")
    return data


def _check_size(size: int, max_bytes: int, what: str, path: Path) -> None:
    if size > max_bytes:
        raise BundleError(f"{what} {path.name} is {size} bytes, over the import limit of {max_bytes} bytes")
