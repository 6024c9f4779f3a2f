"""Garbage collection and the disk tier's policy, on top of :class:`~.store.Store`'s public methods.

:func:`collect_garbage` reconciles the index with the files under ``kv/``.
It first removes what Stores that are provably gone left behind
(:meth:`Store.remove_debris`, no grace period), then finds, and unless
``dry_run`` removes:

- temp files (``.tmp-*``) older than the grace period: a writer that died;
- orphan files: a chunk file with no index row, older than the grace period
  (a crash between a file's rename and its commit, or a cleanup that did not
  finish; the grace period spares a save in flight);
- dangling rows: an index row whose file is missing; handled like a corrupt
  chunk (sessions keep the prefix before it);
- unreferenced rows: a chunk no session uses.

Quarantined files are reported by :meth:`Store.disk_usage` and never deleted here.

When the index looks lost (:meth:`Store.index_lost`: created new, or empty,
while chunk files are on disk), every chunk file would look like an orphan:
gc then keeps them (``report.orphans_kept``), says why in
``report.index_lost`` and logs a warning, unless called with ``force``.

:func:`enforce_disk_policy` applies a :class:`DiskPolicy` (a TTL on idle
sessions' KV, a budget for chunk bytes) and then collects garbage. Histories
are never deleted, only KV.

Neither imports torch: ``chatkv sessions gc`` runs on the index alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import SessionLockedError
from .hashing import ChunkHash, is_chunk_hash
from .paths import CHUNK_SUFFIX, TMP_PREFIX, chunk_path, file_size
from .records import GcReport, SessionInfo

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger(__name__)


def _old(p: Path, cutoff: float) -> bool:
    try:
        return p.stat().st_mtime <= cutoff
    except OSError:
        return False


def collect_garbage(store: "Store", *, dry_run: bool = True, grace_s: float = 600.0,
                    force: bool = False) -> GcReport:
    """Scan ``store`` and return a :class:`GcReport`; remove what it lists unless ``dry_run``.

    Files younger than ``grace_s`` seconds are spared (a save may be in
    flight), except those of Stores that are provably gone, removed first.
    Dangling rows are quarantined (see :meth:`Store.quarantine_chunk`);
    unreferenced rows and their files go through
    :meth:`Store.drop_unreferenced_chunks`, which re-checks under the write
    lock, so a chunk a concurrent save starts using again is kept. Orphan
    files are kept while the index looks lost, unless ``force`` (which then
    also clears the lost-index record). A dry run changes nothing.
    """
    report = GcReport(dry_run=dry_run)
    if not dry_run:
        report.debris = store.remove_debris()
        report.files_removed += report.debris.files_removed
        report.bytes_reclaimed += report.debris.bytes_removed
    report.index_lost = store.index_lost()
    cutoff = time.time() - grace_s
    usage = store.chunk_usage()
    rows = {u.hash: u.relpath for u in usage}
    if store.kv_dir.exists():
        for p in sorted(store.kv_dir.glob("*/*")):
            if p.name.startswith(TMP_PREFIX):
                if _old(p, cutoff):
                    report.temp_files.append(p)
            elif p.name.endswith(CHUNK_SUFFIX):
                h = p.name[: -len(CHUNK_SUFFIX)]
                if (not is_chunk_hash(h) or h not in rows) and _old(p, cutoff):
                    report.orphan_files.append(p)
    for u in usage:
        if not chunk_path(store.kv_dir, u.relpath).exists():
            report.dangling_chunks.append(ChunkHash(u.hash))
        elif u.n_refs == 0:
            report.unreferenced_chunks.append(ChunkHash(u.hash))
    report.orphans_kept = bool(report.index_lost and report.orphan_files) and not force
    doomed = report.temp_files + ([] if report.orphans_kept else report.orphan_files)
    report.reclaimable_bytes = (sum(file_size(p) for p in doomed)
                                + sum(file_size(chunk_path(store.kv_dir, rows[h])) for h in report.unreferenced_chunks))
    if report.orphans_kept and report.orphan_files:
        log.warning("gc: keeping %d orphan chunk files: %s", len(report.orphan_files), report.index_lost)
    if dry_run:
        return report

    for p in doomed:
        size = file_size(p)
        try:
            p.unlink()
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("gc: could not remove %s: %s", p, e)
            continue
        log.debug("gc: removed %s file %s (%d bytes)",
                  "temp" if p.name.startswith(TMP_PREFIX) else "orphan", p, size)
        report.files_removed += 1
        report.bytes_reclaimed += size
    for h in report.dangling_chunks:
        store.quarantine_chunk(h, "file missing (gc)")
    if report.unreferenced_chunks:
        removed = store.drop_unreferenced_chunks(report.unreferenced_chunks)
        log.debug("gc: dropped %d unreferenced chunks (%d files, %d bytes)",
                  len(report.unreferenced_chunks), removed.files_removed, removed.bytes_removed)
        report.files_removed += removed.files_removed
        report.bytes_reclaimed += removed.bytes_removed
    if report.index_lost and force:
        store.forget_lost_index()
    return report


@dataclass(frozen=True)
class DiskPolicy:
    """What the disk tier keeps. ``None`` means no limit.

    Attributes:
        kv_ttl_s: a session's KV is dropped once it has been idle this many
            seconds (its history stays; the next turn re-prefills).
        disk_budget_bytes: chunk bytes the index may hold; over it, the least
            recently used sessions' KV is dropped until it fits.

    Raises:
        ValueError: a negative value.
    """

    kv_ttl_s: float | None = None
    disk_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.kv_ttl_s is not None and not self.kv_ttl_s >= 0:
            raise ValueError(f"kv_ttl_s must be >= 0 or None, not {self.kv_ttl_s!r}")
        if self.disk_budget_bytes is not None and not self.disk_budget_bytes >= 0:
            raise ValueError(f"disk_budget_bytes must be >= 0 or None, not {self.disk_budget_bytes!r}")


@dataclass
class DiskGcReport:
    """What :func:`enforce_disk_policy` did (or, with ``dry_run``, would do).

    ``expired_*`` are sessions whose KV passed the TTL, ``over_budget_*`` those
    dropped to fit the budget; their bytes are the bytes freed (in a dry run,
    the bytes only those sessions use). The file and chunk counts are
    :func:`collect_garbage`'s; ``bytes_reclaimed`` adds everything up.
    ``disk_bytes_*`` are the chunk files' bytes on disk before and after.
    ``index_lost`` and ``orphans_kept`` are :func:`collect_garbage`'s: the
    index looks lost, so orphan files were kept.
    """

    dry_run: bool
    index_lost: str | None = None
    orphans_kept: bool = False
    expired_sessions: list[str] = field(default_factory=list)
    expired_bytes: int = 0
    over_budget_sessions: list[str] = field(default_factory=list)
    over_budget_bytes: int = 0
    orphan_files: int = 0
    temp_files: int = 0
    dangling_chunks: int = 0
    unreferenced_chunks: int = 0
    files_removed: int = 0
    bytes_reclaimed: int = 0
    disk_bytes_before: int = 0
    disk_bytes_after: int = 0
    seconds: float = 0.0


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def ttl_of(info: SessionInfo, policy: DiskPolicy) -> float | None:
    """The idle seconds after which ``info``'s KV expires: never for a pinned
    session, else its own TTL (``Chat(ttl=...)``, ``chatkv sessions ... --ttl``)
    if it has one, else the policy's."""
    if info.pinned:
        return None
    return info.kv_ttl_s if info.kv_ttl_s is not None else policy.kv_ttl_s


def enforce_disk_policy(
    store: "Store", policy: DiskPolicy | None = None, *, dry_run: bool = False, grace_s: float = 600.0,
    now: datetime | None = None, skip: Iterable[str] = (), force: bool = False,
) -> DiskGcReport:
    """Enforce the disk tier, then collect garbage; return what was (or would be) freed.

    In order: drop the KV of sessions idle for their TTL or longer (as of
    ``now``, default the current time; see :func:`ttl_of`: a session's own TTL
    overrides ``policy.kv_ttl_s``, a pinned one never expires); then, while
    the index's chunk bytes exceed ``policy.disk_budget_bytes``, drop the KV of
    the least recently used remaining session (pinned ones last); then :func:`collect_garbage` with
    ``grace_s`` and ``force``. Dropping KV is :meth:`Store.invalidate_kv`: histories are
    never deleted. Sessions in ``skip``, sessions without KV, and sessions
    another live owner holds a lease on are left alone, so this is safe while
    apps use the store. With ``dry_run`` nothing changes and the report says
    what would go.
    """
    policy = policy or DiskPolicy()
    started = time.perf_counter()
    now = _aware(now or datetime.now(timezone.utc))
    skipped = set(skip)
    before = store.disk_usage().file_bytes
    report = DiskGcReport(dry_run=dry_run)

    def drop(info: SessionInfo) -> int | None:
        """Bytes freed by dropping this session's KV; None if another owner is using it."""
        if store.lease_holder(info.id) is not None:
            return None
        if dry_run:
            return store.session_bytes(info.id).unique
        try:
            return store.invalidate_kv(info.id).bytes_removed
        except SessionLockedError:  # leased between the check and the write
            return None

    sessions = [s for s in store.list_sessions() if s.id not in skipped and s.n_cached]
    for info in sessions:
        ttl = ttl_of(info, policy)
        if ttl is not None and (now - _aware(info.last_used_at)).total_seconds() >= ttl:
            got = drop(info)
            if got is not None:
                log.debug("disk policy: expired the KV of %r (%d bytes)", info.id, got)
                report.expired_sessions.append(info.id)
                report.expired_bytes += got
    expired = set(report.expired_sessions)
    sessions = [s for s in sessions if s.id not in expired]
    if policy.disk_budget_bytes is not None:
        usage = store.disk_usage().indexed_bytes - (report.expired_bytes if dry_run else 0)
        # Least recently used first, pinned sessions only after every unpinned one.
        for info in sorted(sessions, key=lambda s: (s.pinned, _aware(s.last_used_at))):
            if usage <= policy.disk_budget_bytes:
                break
            got = drop(info)
            if got is not None:
                log.debug("disk policy: dropped the KV of %r to fit the budget (%d bytes)", info.id, got)
                report.over_budget_sessions.append(info.id)
                report.over_budget_bytes += got
                usage -= got
    gc = collect_garbage(store, dry_run=dry_run, grace_s=grace_s, force=force)
    report.index_lost = gc.index_lost
    report.orphans_kept = gc.orphans_kept
    report.orphan_files = len(gc.orphan_files)
    report.temp_files = len(gc.temp_files)
    report.dangling_chunks = len(gc.dangling_chunks)
    report.unreferenced_chunks = len(gc.unreferenced_chunks)
    report.files_removed = gc.files_removed
    report.bytes_reclaimed = ((gc.reclaimable_bytes if dry_run else gc.bytes_reclaimed)
                              + report.expired_bytes + report.over_budget_bytes)
    report.disk_bytes_before = before
    report.disk_bytes_after = store.disk_usage().file_bytes
    report.seconds = time.perf_counter() - started
    return report
