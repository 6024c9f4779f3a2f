"""Unpacking a session archive (``.tar``, ``.tar.gz``, ...) made by ``chatkv sessions export``: untrusted input.

The archive is read as a stream, one member at a time, never listed up front
and never extracted whole. Only the bundle's two names are extracted, as
regular files, into the given directory; anything else that is a link, device,
FIFO or sparse file under those names is refused, and other members are
skipped unread. Before any member's data is read its declared size is checked
against its own cap and the running total of everything declared so far
against :attr:`~.bundle.BundleLimits.archive_bytes` (skipped members count
too: skipping still decompresses them), and bytes are counted again while
copying. So a gzip bomb is refused after at most one block of output, with
neither memory nor disk filled.
"""

from __future__ import annotations

import os
import posixpath
import tarfile
from pathlib import Path
from typing import IO

from .bundle import HISTORY_FILE, KV_FILE, BundleLimits
from .errors import BundleError

#: Names a session archive may contain (what :func:`~.bundle.export_session` writes).
BUNDLE_MEMBERS = (HISTORY_FILE, KV_FILE)
_COPY_BLOCK = 1 << 20
#: Largest pax or GNU long-name header accepted: tarfile reads those into memory whole.
MAX_META_HEADER = 1 << 20
_META_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
               tarfile.GNUTYPE_LONGLINK)


class _GuardedTarInfo(tarfile.TarInfo):
    """Refuses, before tarfile reads them, the headers it would buffer unbounded:
    a huge pax or GNU long-name header, and GNU sparse maps (a chain of blocks)."""

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        buf = tarfile_.fileobj.read(tarfile.BLOCKSIZE)  # type: ignore[union-attr]
        obj = cls.frombuf(buf, tarfile_.encoding, tarfile_.errors)  # type: ignore[arg-type]
        obj.offset = tarfile_.fileobj.tell() - tarfile.BLOCKSIZE  # type: ignore[union-attr]
        if obj.type in _META_TYPES and obj.size > MAX_META_HEADER:
            raise BundleError(f"the archive has a {obj.size}-byte extended header; refused "
                              f"(over {MAX_META_HEADER} bytes)")
        if obj.type == tarfile.GNUTYPE_SPARSE:
            raise BundleError("the archive holds a sparse file; refused")
        return obj._proc_member(tarfile_)  # type: ignore[attr-defined]


def extract_archive(archive: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                    limits: BundleLimits | None = None) -> Path:
    """Extract a session archive's bundle files into the existing, empty directory ``dest``; return ``dest``.

    ``archive`` may be any tar file Python reads (plain, gzip, bzip2, xz), or a pipe.

    Raises:
        BundleError: not a readable archive, no ``history.json``, an unsafe
            member, or more data than ``limits`` allow (what was extracted so
            far stays in ``dest``, which the caller removes).
    """
    limits = limits or BundleLimits()
    dest = Path(dest)
    name = Path(archive).name
    caps = {HISTORY_FILE: limits.max_history_bytes, KV_FILE: limits.max_kv_bytes}
    total = members = 0
    got: set[str] = set()
    try:
        with open(archive, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*", tarinfo=_GuardedTarInfo) as tar:
            for m in tar:
                members += 1
                if members > limits.max_members:
                    raise BundleError(f"{name} has more than {limits.max_members} entries; not a session archive")
                total += max(int(m.size), 0)
                if total > limits.archive_bytes:
                    raise BundleError(f"{name} expands to more than the import limit of {limits.archive_bytes} "
                                      "bytes; refused before extracting it")
                member = posixpath.normpath(m.name)
                if member not in BUNDLE_MEMBERS:
                    continue
                if not m.isreg() or m.issparse():
                    raise BundleError(f"{name}: {member} is not a regular file (links, devices and FIFOs are refused)")
                if member in got:
                    raise BundleError(f"{name} holds {member} twice")
                if m.size > caps[member]:
                    raise BundleError(f"{name}: {member} is {m.size} bytes, over the import limit of "
                                      f"{caps[member]} bytes")
                src = tar.extractfile(m)
                if src is None:  # pragma: no cover - isreg() members always have data
                    raise BundleError(f"{name}: {member} has no data")
                with src:
                    _copy(src, dest / member, m.size, f"{name}: {member}")
                got.add(member)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise BundleError(f"{name} is not a readable chatkv session archive: {e}") from e
    if HISTORY_FILE not in got:
        raise BundleError(f"{name} is not a chatkv session archive (no {HISTORY_FILE})")
    return dest


def _copy(src: IO[bytes], path: Path, size: int, what: str) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as out:
        left = size
        while True:
            block = src.read(min(_COPY_BLOCK, left + 1))
            if not block:
                break
            left -= len(block)
            if left < 0:
                raise BundleError(f"{what} holds more data than it declares")
            out.write(block)
    if left:
        raise BundleError(f"{what} is shorter than it declares (a truncated archive)")
