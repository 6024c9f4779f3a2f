"""Garbage collection primitives: reconcile the index with the files under ``kv/``.

Finds, and unless ``dry_run`` removes:

- temp files (``.tmp-*``) older than the grace period: a writer that died;
- orphan files: a chunk file with no index row, older than the grace period
  (a crash between a file's rename and its commit, or a cleanup that did not
  finish; the grace period spares a save in flight);
- dangling rows: an index row whose file is missing; handled like a corrupt
  chunk (sessions keep the prefix before it);
- unreferenced rows: a chunk no session uses.

Quarantined files are reported by :meth:`Store.disk_usage` and never deleted here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import select

from .hashing import ChunkHash, is_chunk_hash
from .paths import CHUNK_SUFFIX, TMP_PREFIX
from .records import GcReport
from .schema import ChunkRow, SessionChunkRow

if TYPE_CHECKING:
    from .store import Store


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _old(p: Path, cutoff: float) -> bool:
    try:
        return p.stat().st_mtime <= cutoff
    except OSError:
        return False


def collect(store: "Store", *, dry_run: bool, grace_s: float) -> GcReport:
    """Scan ``store`` and return a :class:`GcReport`; remove what it lists unless ``dry_run``."""
    report = GcReport(dry_run=dry_run)
    cutoff = time.time() - grace_s
    with store._tx(write=False) as s:
        rows = {h: rel for h, rel in s.execute(select(ChunkRow.hash, ChunkRow.relpath))}
        referenced = set(s.scalars(select(SessionChunkRow.chunk_hash).distinct()))
    if store.kv_dir.exists():
        for p in sorted(store.kv_dir.glob("*/*")):
            if p.name.startswith(TMP_PREFIX):
                if _old(p, cutoff):
                    report.temp_files.append(p)
            elif p.name.endswith(CHUNK_SUFFIX):
                h = p.name[: -len(CHUNK_SUFFIX)]
                if (not is_chunk_hash(h) or h not in rows) and _old(p, cutoff):
                    report.orphan_files.append(p)
    for h, rel in rows.items():
        if not (store.home / rel).exists():
            report.dangling_chunks.append(ChunkHash(h))
        elif h not in referenced:
            report.unreferenced_chunks.append(ChunkHash(h))
    report.reclaimable_bytes = (sum(_size(p) for p in report.orphan_files + report.temp_files)
                                + sum(_size(store.home / rows[h]) for h in report.unreferenced_chunks))
    if dry_run:
        return report

    for p in report.temp_files + report.orphan_files:
        size = _size(p)
        try:
            p.unlink()
        except OSError:
            continue
        report.files_removed += 1
        report.bytes_reclaimed += size
    for h in report.dangling_chunks:
        store.quarantine_chunk(h, "file missing (gc)")
    if report.unreferenced_chunks:
        with store._tx() as s:
            dead = store._drop_unreferenced(s, set(report.unreferenced_chunks))
        removed = store._unlink_if_unindexed(dead)
        report.files_removed += removed.files_removed
        report.bytes_reclaimed += removed.bytes_removed
    return report
