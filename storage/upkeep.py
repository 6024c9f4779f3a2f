"""The Store's upkeep: removing crash debris at once, and noticing a lost index.

A mixin of :class:`~.store.Store` (its own file only to keep ``store.py`` to
one screenful of concerns): it uses the Store's transactions and paths, and
adds :meth:`remove_debris`, :meth:`index_lost` and :meth:`forget_lost_index`.
Imports no torch.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from . import owners
from .errors import StorageError
from .quickread import count_chunk_files, lost_index_message, scandir
from .paths import TMP_PREFIX, file_size, tmp_token
from .records import DebrisReport
from .schema import META_INDEX_LOST, ChunkRow, MetaRow, PendingFileRow, SessionRow, utcnow

log = logging.getLogger("chatkv.storage.store")


class StoreUpkeep:
    """Crash debris and lost-index detection, for :class:`~.store.Store`."""

    home: Path
    kv_dir: Path
    db_url: str
    token: str
    read_only: bool
    _schema: int
    _tx: Callable[..., AbstractContextManager[Session]]
    path_of: Callable[[str], Path]

    # ------------------------------------------------------------------ crash debris

    def remove_debris(self) -> DebrisReport:
        """Remove at once what Stores that are provably gone left behind; return what went.

        A Store is gone when its lock file (``owners/<token>.lock``) can be
        locked: the kernel drops the lock when its process exits, ``kill -9``
        included. Its temp files (named with its token) and the chunk files it
        recorded as pending (written for a commit that never came, or dropped
        by a commit and not unlinked yet) that no index row names and no live
        Store has pending are removed, without gc's grace period. Runs when a
        Store opens and before gc; a no-op on a read-only Store.

        Raises:
            StorageWriteError: the index transaction failed (the leftovers stay for the next try).
        """
        if self.read_only:
            return DebrisReport()
        gone = owners.gone_owners(self.home, exclude=self.token)
        if not gone:
            return DebrisReport()
        try:
            report = DebrisReport(owners=sorted(gone))
            for p in self._temp_files(set(gone)):
                size = file_size(p)
                if _unlink(p):
                    report.temp_files.append(p)
                    report.bytes_removed += size
            for p, size in self._reap_pending(set(gone)):
                report.chunk_files.append(p)
                report.bytes_removed += size
        except BaseException:
            for fd in gone.values():
                os.close(fd)
            raise
        owners.forget(self.home, gone)
        if report.files_removed:
            log.info("removed %d files (%d bytes) left by %d stopped chatkv store(s)",
                     report.files_removed, report.bytes_removed, len(gone))
        return report

    def _temp_files(self, tokens: set[str]) -> list[Path]:
        """Temp files under ``kv/`` named with one of ``tokens``."""
        out = []
        for sub in scandir(self.kv_dir):
            if sub.is_dir(follow_symlinks=False):
                out.extend(Path(e.path) for e in scandir(Path(sub.path))
                           if e.name.startswith(TMP_PREFIX) and tmp_token(e.name) in tokens)
        return out

    def _reap_pending(self, tokens: set[str], hashes: set[str] | None = None) -> list[tuple[Path, int]]:
        """Unlink the pending files of ``tokens`` (optionally only ``hashes``) that no row names
        and no other Store has pending, and forget those records; return what was unlinked.

        Unlinks under the index's write lock: a save that commits one of them
        afterwards finds it missing and writes it again from its payload.
        """
        removed: list[tuple[Path, int]] = []
        with self._tx() as s:
            q = select(PendingFileRow.chunk_hash).where(PendingFileRow.token.in_(tokens))
            if hashes is not None:
                q = q.where(PendingFileRow.chunk_hash.in_(hashes))
            mine = set(s.scalars(q))
            if not mine:
                return removed
            indexed = set(s.scalars(select(ChunkRow.hash).where(ChunkRow.hash.in_(mine))))
            others = set(s.scalars(select(PendingFileRow.chunk_hash).where(
                PendingFileRow.chunk_hash.in_(mine), PendingFileRow.token.not_in(tokens))))
            for h in sorted(mine - indexed - others):
                p = self.path_of(h)
                size = file_size(p)
                if _unlink(p):
                    removed.append((p, size))
            s.execute(delete(PendingFileRow).where(PendingFileRow.token.in_(tokens),
                                                   PendingFileRow.chunk_hash.in_(mine)))
        return removed

    # ------------------------------------------------------------------ a lost index

    def _note_new_index(self) -> None:
        """This Store just created the index: if chunk files are here already, the old one was lost."""
        n = self._count_chunk_files()
        if not n:
            return
        when = utcnow()
        why = (f"it was created new on {when.isoformat(timespec='seconds')} while {self.kv_dir} "
               f"already held {n} chunk files")
        try:
            with self._tx() as s:
                s.merge(MetaRow(key=META_INDEX_LOST, value=json.dumps({"reason": why, "files": n}), updated_at=when))
        except StorageError as e:
            log.warning("could not record that the index looks lost: %s", e)
        log.warning("the chatkv index at %s looks lost: %s; gc will keep those files "
                    "(see `chatkv sessions gc --help`)", self.db_url, why)

    def index_lost(self) -> str | None:
        """Why the index looks lost, or None when it looks whole.

        It looks lost when chunk files are on disk and either it was created
        over them (recorded when this or an earlier Store created it: the old
        index was deleted or truncated) or it has no sessions and no chunks at
        all (emptied). Chunk files then cannot be told from orphans, so gc
        keeps them unless forced. Reads the index and lists ``kv/``.
        """
        if self._schema < 4:
            return None
        with self._tx(write=False) as s:
            marker = s.get(MetaRow, META_INDEX_LOST)
            empty = marker is None and not s.scalar(select(func.count()).select_from(SessionRow)) \
                and not s.scalar(select(func.count()).select_from(ChunkRow))
            why = json.loads(marker.value).get("reason") if marker is not None else None
        if marker is None and not empty:
            return None
        n = self._count_chunk_files()
        if not n:
            return None
        return lost_index_message(self.db_url, self.kv_dir, why, n)

    def forget_lost_index(self) -> None:
        """Clear the lost-index record (after its files were dealt with); gc then treats orphans as usual."""
        with self._tx() as s:
            s.execute(delete(MetaRow).where(MetaRow.key == META_INDEX_LOST))

    def _count_chunk_files(self) -> int:
        return count_chunk_files(self.kv_dir)


def _unlink(p: Path) -> bool:
    """Remove ``p``; True if this call removed it. Other failures are logged."""
    try:
        p.unlink()
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("could not remove %s: %s", p, e)
        return False
    return True
