"""``Store``: the one object the engine and the CLI use for durable state.

Ordering rule: chunk files are written and fsynced before the transaction
that names them commits; files that stop being referenced are unlinked only
after the commit, under the index's write lock and only if still
unreferenced. A crash therefore leaves the old or the new index state, plus
at worst orphan or temp files that :func:`~chatkv.storage.gc.collect_garbage`
removes. (``docs/architecture.md`` places this among the project's other
invariants.)

Deleting a session, invalidating its KV or replacing its chunk list removes
chunk files whose last reference went away at once (not left for gc).

This module is the index side: it never imports torch. Tensors pass through
:meth:`Store.write_chunk`, :meth:`Store.read_chunk`, :meth:`Store.iter_kv`
and :meth:`Store.load_kv`, whose chunk-file code (:mod:`.chunkfile`) imports
torch on first use. :mod:`.bundle` and :mod:`.gc` build on this module's
public methods; it imports neither.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sqlalchemy import bindparam, delete, false, func, literal, not_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from . import leases, nativeread, owners
from .chunkfile import (
    ChunkFile,
    ChunkMeta,
    atomic_write,
    ChunkReader,
    Converted,
    encode_chunk,
    ensure_dir,
    open_chunk_file,
    read_chunk_file,
    read_safetensors_metadata,
)
from .db import make_engine, open_read_only, sqlite_path
from .errors import (
    CorruptChunkError,
    FingerprintMismatchError,
    LeaseLostError,
    MissingChunkError,
    SessionExistsError,
    SessionNotFoundError,
    StorageError,
    StorageWriteError,
)
from .hashing import ChunkHash, chunk_hash, pack_token_ids, unpack_token_ids
from .ids import validate_session_id
from .migrations import LATEST_VERSION, readable_version, upgrade
from .quickread import disk_usage_of
from .upkeep import StoreUpkeep
from .paths import (
    CHUNK_SUFFIX,
    QUARANTINE_DIR,
    chunk_file,
    chunk_path,
    chunk_relpath,
    default_db_url,
    default_home,
    default_kv_dir,
)
from .records import (
    ChunkInfo,
    ChunkUsage,
    DebrisReport,
    DiskUsage,
    LoadedChunk,
    MessageRecord,
    NewChunk,
    NewMessage,
    RemoveResult,
    SaveResult,
    SessionBytes,
    SessionInfo,
    SessionKV,
)
from .schema import (
    MESSAGE_OUTSIDE_WINDOW,
    MESSAGE_PARTIAL,
    ChunkRow,
    LeaseRow,
    MessageRow,
    PendingFileRow,
    SessionChunkRow,
    SessionRow,
    utcnow,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: A chunk file dropped from the index: (hash, path relative to the home).
_Dead = tuple[str, str]


#: A message to store: ``(role, content, token_span, partial[, outside_window])``.
MessageTuple = tuple[str, str, "tuple[int, int] | None", bool] | tuple[str, str, "tuple[int, int] | None", bool, bool]


def _flags(partial: bool, outside_window: bool) -> int:
    """A message row's flag bits."""
    return (MESSAGE_PARTIAL if partial else 0) | (MESSAGE_OUTSIDE_WINDOW if outside_window else 0)


def _info(row: Any, written: int = 0) -> ChunkInfo:
    """A chunk's :class:`ChunkInfo` from its :class:`ChunkRow`, or from a row of
    :data:`_CHUNK_LIST` (the same names)."""
    return ChunkInfo(
        hash=ChunkHash(row.hash), parent=ChunkHash(row.parent) if row.parent else None,
        relpath=row.relpath, n_tokens=row.n_tokens, bytes=row.bytes, fingerprint=row.fingerprint,
        kv_format=row.kv_format, quant=row.quant, dtype=row.dtype, block_size=row.block_size,
        written=written, verified=bool(row.verified),
    )


def chunk_row(info: ChunkInfo) -> ChunkRow:
    """A new index row for ``info`` (not added to any transaction). No side effects."""
    return ChunkRow(
        hash=info.hash, parent=info.parent, relpath=info.relpath, n_tokens=info.n_tokens,
        bytes=info.bytes, fingerprint=info.fingerprint, kv_format=info.kv_format, quant=info.quant,
        dtype=info.dtype, block_size=info.block_size, created_at=utcnow(), verified=info.verified,
    )


@dataclass
class _Prepared:
    """Chunks checked and written by :meth:`Store._write_chunks`, waiting for their commit."""

    trusted: bool = True
    """The new chunks' tensors come from the model's engine (not from an import)."""
    infos: list[ChunkInfo] = field(default_factory=list)
    payload: dict[str, tuple[list[int], NewChunk]] = field(default_factory=dict)
    written: int = 0
    files_written: int = 0


def _count_of(model: Any, *where: Any) -> Any:
    return (select(func.count()).select_from(model).where(model.session_id == SessionRow.id, *where)
            .correlate(SessionRow).scalar_subquery())


# The statements of opening a session for a turn (:meth:`Store.open_leased`),
# built once over the tables' columns and run on the transaction's connection
# (with :mod:`.leases`' own): building an ORM statement, its cache key and the
# ORM's execution and row loading cost more than SQLite's own work for them.
_SESSIONS, _MESSAGES = SessionRow.__table__, MessageRow.__table__
_CHUNKS, _SESSION_CHUNKS = ChunkRow.__table__, SessionChunkRow.__table__
#: Sets a session's ``last_used_at``; its row count says whether the session exists.
_TOUCH = update(_SESSIONS).where(_SESSIONS.c.id == bindparam("sid")).values(last_used_at=bindparam("now"))
#: What a restore needs of the session's row: its KV's fingerprint and token ids.
_KV_ROW = (select(_SESSIONS.c.fingerprint, _SESSIONS.c.n_cached, _SESSIONS.c.cached_ids)
           .where(_SESSIONS.c.id == bindparam("sid")))
_EXISTS = select(_SESSIONS.c.id).where(_SESSIONS.c.id == bindparam("sid"))
#: A session's messages in order, as :class:`MessageRecord` needs them.
_MESSAGE_LIST = (select(_MESSAGES.c.idx, _MESSAGES.c.role, _MESSAGES.c.content, _MESSAGES.c.tok_start,
                        _MESSAGES.c.tok_end, _MESSAGES.c.created_at, _MESSAGES.c.flags)
                 .where(_MESSAGES.c.session_id == bindparam("sid")).order_by(_MESSAGES.c.idx))
#: A session's chunk rows in chunk-list order: the columns :func:`_info` reads, by name.
_CHUNK_LIST = (select(_CHUNKS.c.hash, _CHUNKS.c.parent, _CHUNKS.c.relpath, _CHUNKS.c.n_tokens, _CHUNKS.c.bytes,
                      _CHUNKS.c.fingerprint, _CHUNKS.c.kv_format, _CHUNKS.c.quant, _CHUNKS.c.dtype,
                      _CHUNKS.c.block_size, _CHUNKS.c.verified)
               .join_from(_SESSION_CHUNKS, _CHUNKS, _SESSION_CHUNKS.c.chunk_hash == _CHUNKS.c.hash)
               .where(_SESSION_CHUNKS.c.session_id == bindparam("sid")).order_by(_SESSION_CHUNKS.c.position))


def _check_exists(conn: Any, session_id: str) -> None:
    """Raise :class:`SessionNotFoundError` unless the session has a row (for a
    read that found none of its rows: an empty list, or no such session)."""
    if conn.execute(_EXISTS, {"sid": session_id}).first() is None:
        raise SessionNotFoundError(f"no session {session_id!r}")


#: The id :meth:`Store.warm_up` runs its statements for (rolled back: any session may have it).
WARM_UP_SESSION_ID = "chatkv-warm-up"

#: The session links a chunk only an import vouches for.
_HAS_UNVERIFIED = (select(SessionChunkRow.session_id)
                   .join(ChunkRow, ChunkRow.hash == SessionChunkRow.chunk_hash)
                   .where(SessionChunkRow.session_id == SessionRow.id, ChunkRow.verified == false())
                   .correlate(SessionRow).exists())

#: One row per session, in :class:`SessionInfo` field order. The counts are
#: correlated subqueries (index lookups), so listing N sessions is one
#: statement, and the token-id blob is never read.
_INFO_COLUMNS = (
    SessionRow.id, SessionRow.fingerprint, SessionRow.system_prompt, SessionRow.created_at,
    SessionRow.updated_at, SessionRow.last_used_at, SessionRow.n_cached,
    _count_of(MessageRow), _count_of(MessageRow, MessageRow.role == "user"), _count_of(SessionChunkRow),
    SessionRow.kv_bytes, SessionRow.tier, SessionRow.kv_generation, not_(_HAS_UNVERIFIED),
)
#: The same, for a read-only index older than schema v4 (which could not be migrated).
_INFO_COLUMNS_V3 = (*_INFO_COLUMNS[:-1], literal(True))
#: Retention (schema v5), or what an older read-only index means: unpinned, the store's TTL.
_RETENTION_COLUMNS = (SessionRow.pinned, SessionRow.kv_ttl_s)
_RETENTION_COLUMNS_V4 = (literal(False), literal(None))


def _infos_select(schema: int) -> Any:
    """Every session's :class:`SessionInfo` row, most recently used first, for an index at ``schema``."""
    cols = (*(_INFO_COLUMNS if schema >= 4 else _INFO_COLUMNS_V3),
            *(_RETENTION_COLUMNS if schema >= 5 else _RETENTION_COLUMNS_V4))
    return select(*cols).order_by(SessionRow.last_used_at.desc(), SessionRow.id)


def _as_info(r: Any) -> SessionInfo:
    return SessionInfo(*(r[:7]), *(int(n or 0) for n in r[7:10]), *r[10:13], bool(r[13]), bool(r[14]),
                       None if r[15] is None else float(r[15]))


def _session_infos(s: Session, *where: Any, schema: int = LATEST_VERSION) -> list[SessionInfo]:
    return [_as_info(r) for r in s.execute(_infos_select(schema).where(*where))]


#: One session's info row, by schema version: built once (see :data:`_TOUCH`).
_ONE_INFO: dict[int, Any] = {}


def _one_session_info(s: Session, session_id: str, schema: int) -> SessionInfo | None:
    q = _ONE_INFO.get(schema)
    if q is None:
        q = _ONE_INFO[schema] = _infos_select(schema).where(SessionRow.id == bindparam("sid"))
    row = s.connection().execute(q, {"sid": session_id}).first()
    return None if row is None else _as_info(row)


def _index_is_read_only(home: Path, db_url: str) -> bool:
    """The home exists but this process cannot write it (or the SQLite index file in it)."""
    if not home.exists():
        return False
    if not os.access(home, os.W_OK):
        return True
    path = sqlite_path(db_url)
    return bool(path and os.path.exists(path) and not os.access(path, os.W_OK))


class Store(StoreUpkeep):
    """Durable sessions: the SQLAlchemy index plus content-addressed chunk files.

    Args:
        home: the data directory; default ``$CHATKV_HOME`` or the user data dir.
            Created if missing.
        db_url: any SQLAlchemy URL; default ``$CHATKV_DB_URL`` or
            ``sqlite:///<home>/index.db``.
        kv_dir: the chunk files' directory; default ``$CHATKV_KV_DIR`` or
            ``<home>/kv``. Servers sharing one index share this directory too
            (each keeps its own home: owner locks, quarantine, REPL history).
        owner: lease owner id; default ``host:pid:random:place`` (unique per
            Store; see :func:`.leases.make_owner_id`).
        lease_ttl_s: how long a lease lives without renewal.
        clock: the current time (aware UTC) by which this Store judges whether
            another owner's lease has expired; default the system clock. Tests
            pass a fixed or advanced clock instead of sleeping past an expiry.
        read_only: open without writing anything (no home, tables, migrations,
            lock file or cleanup; an SQLite index is opened read-only). Default:
            when the home (or its index file) exists but is not writable, so
            ``sessions ls`` and ``show`` work on a read-only home. Every write
            then fails with :class:`StorageWriteError`.
        warm: run the statements of a session's reopen and restore once, in
            a background thread, so that the first ``Chat()`` finds them
            compiled (:meth:`warm_up`), and build or load the native chunk
            reads in another (:mod:`.nativeread`). Not for a read-only Store.

    Side effects (unless read-only): creates the home, the index tables, runs
    pending schema migrations, takes this Store's owner lock
    (``owners/<token>.lock``) and removes the leftovers of Stores that are
    provably gone (:attr:`debris_removed`). An index created over a home that
    already holds chunk files is recorded as lost (:meth:`index_lost`), so gc
    keeps those files. Thread-safe (one SQLAlchemy session per call).

    Raises:
        StorageWriteError: the home cannot be created.
        SchemaVersionError: the index is newer than this chatkv, or not chatkv's.
        StorageError: the index cannot be opened (a read-only home without one, a damaged file).
    """

    def __init__(
        self,
        home: str | os.PathLike[str] | None = None,
        db_url: str | None = None,
        *,
        kv_dir: str | os.PathLike[str] | None = None,
        owner: str | None = None,
        lease_ttl_s: float = 30.0,
        clock: Callable[[], datetime] = utcnow,
        read_only: bool | None = None,
        warm: bool = True,
    ) -> None:
        self.home = Path(home).expanduser() if home is not None else default_home()
        self.db_url = db_url or default_db_url(self.home)
        self.read_only = _index_is_read_only(self.home, self.db_url) if read_only is None else read_only
        """Nothing is written: a home this process cannot write (or ``read_only=True``)."""
        if not self.read_only:
            ensure_dir(self.home)
        self.kv_dir = Path(kv_dir).expanduser() if kv_dir is not None else default_kv_dir(self.home)
        self.quarantine_dir = self.home / QUARANTINE_DIR
        self.owner = owner or leases.make_owner_id()
        self.token = owners.new_token()
        """This Store's owner token: it names its temp files, pending files and lock file."""
        self.lease_ttl_s = lease_ttl_s
        self.clock = clock
        self._leases: dict[str, leases.Lease] = {}
        self._lock = threading.Lock()
        self._owner_lock: owners.OwnerLock | None = None
        self._warming: threading.Thread | None = None
        self.bytes_written = 0
        """Bytes of chunk files this Store wrote since it was opened."""
        self.index_created = False
        """This Store created the index's tables (the database was missing, empty or truncated)."""
        self.debris_removed = DebrisReport()
        """What opening removed: the leftovers of Stores that are provably gone."""
        self.engine = open_read_only(self.db_url, self.home) if self.read_only else make_engine(self.db_url)
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        try:
            if self.read_only:
                self._schema = readable_version(self.engine)
            else:
                self.index_created = upgrade(self.engine) == 0
                self._schema = LATEST_VERSION
        except SQLAlchemyError as e:
            self.engine.dispose()
            raise StorageError(f"cannot open the index at {self.db_url}: {e}") from e
        except StorageError:
            self.engine.dispose()
            raise
        if self.read_only:
            return
        if self.index_created:
            self._note_new_index()
        self._owner_lock = owners.OwnerLock(self.home, self.token, self.owner)
        try:
            self.debris_removed = self.remove_debris()
        except StorageError as e:  # a busy or failing index: the leftovers wait for the next open or gc
            log.warning("could not remove the leftovers of stopped chatkv processes now: %s", e)
        if warm:
            self._warming = threading.Thread(target=self._warm_in_background, name="chatkv-store-warm-up",
                                             daemon=True)
            self._warming.start()
            nativeread.prepare_in_background()  # ready before a first restore (reads never wait for it)

    # ------------------------------------------------------------------ plumbing

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[Session]:
        try:
            with self._session() as s, s.begin():
                yield s
        except SQLAlchemyError as e:
            cls = StorageWriteError if write else StorageError
            raise cls(f"index {'write' if write else 'read'} failed: {e}") from e

    def warm_up(self) -> None:
        """Run, once, the index statements that opening a session and restoring
        its KV make (reading the session row, its facts, its messages, its
        chunk list, its lease; inserting a first lease row; updating its last
        use and its lease row), for the id :data:`WARM_UP_SESSION_ID`, and
        roll the transaction back.
        SQLAlchemy compiles each statement the first time it runs and caches
        it: a first ``Chat()`` of a process spent about 10 ms of its 15 ms on
        those compiles here. Changes nothing in the index.

        Raises:
            StorageError: the index failed.
        """
        sid = WARM_UP_SESSION_ID
        try:
            with self._session() as s:
                conn = s.connection()
                for statement in (_KV_ROW, _EXISTS, _MESSAGE_LIST, _CHUNK_LIST):
                    conn.execute(statement, {"sid": sid}).all()
                _one_session_info(s, sid, self._schema)
                leases.foreign_holder(s, sid, self.owner, self.clock())
                # The writes of an open (a write lock for a moment on SQLite): the
                # ORM insert of a session's first lease row (its flush compiles
                # the most, about 3 ms), then a reopen's two updates, matching no row.
                now = utcnow()
                if leases.read_holder(s, sid) is None:
                    leases.try_acquire(s, sid, self.owner, self.lease_ttl_s, now)
                conn.execute(_TOUCH, {"sid": sid, "now": now})
                leases.take_row(s, sid, leases.Holder("", -1, now), self.owner, 0, now, now)
                s.rollback()
        except SQLAlchemyError as e:
            raise StorageError(f"index warm-up failed: {e}") from e

    def _warm_in_background(self) -> None:
        try:
            self.warm_up()
        except Exception:  # noqa: BLE001 - only the first open's speed depends on it
            log.warning("warming up the index's statements failed (the first open compiles them)", exc_info=True)

    def close(self) -> None:
        """Release this Store's leases, remove chunk files it wrote for saves that
        never committed, drop its owner lock and its database connections. Idempotent."""
        warming = self._warming
        if warming is not None and warming is not threading.current_thread():
            warming.join()
        with self._lock:
            held = list(self._leases.values())
            self._leases.clear()
            lock, self._owner_lock = self._owner_lock, None
        for lease in held:
            try:
                lease.release()
            except Exception as e:  # the row then lapses at its expiry; closing must go on
                log.warning("could not release the lease on session %r while closing: %s", lease.session_id, e)
        if lock is not None:
            try:
                self._reap_pending({self.token})
            except StorageError as e:  # they stay recorded; the next open removes them
                log.warning("could not remove this store's uncommitted chunk files while closing: %s", e)
            lock.release()
        self.engine.dispose()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _check_lease(self, s: Session, session_id: str) -> None:
        """The lease check of every write to ``session_id``, run in the write's
        transaction before it writes anything.

        If this Store holds the session's lease, the write is fenced by its
        token (:func:`.leases.fence`: a conditional UPDATE of the lease row, so
        a takeover is ordered before or after the whole write); a lost lease
        refuses it with :class:`LeaseLostError`, whoever holds the session now.
        Without a lease (the CLI, gc), the write may go ahead only while no
        other live owner holds one (:class:`SessionLockedError`).
        """
        with self._lock:
            lease = self._leases.get(session_id)
        if lease is not None:
            leases.fence(s, lease)
        else:
            leases.check_not_locked(s, session_id, self.owner, self.clock())

    def _get(self, s: Session, session_id: str) -> SessionRow:
        row = s.get(SessionRow, validate_session_id(session_id))
        if row is None:
            raise SessionNotFoundError(f"no session {session_id!r}")
        return row

    def _session_info(self, s: Session, session_id: str) -> SessionInfo:
        found = _one_session_info(s, validate_session_id(session_id), self._schema)
        if found is None:
            raise SessionNotFoundError(f"no session {session_id!r}")
        return found

    def path_of(self, info: ChunkInfo | str) -> Path:
        """Absolute path of a chunk file, from its info or hash."""
        rel = info.relpath if isinstance(info, ChunkInfo) else chunk_relpath(ChunkHash(info))
        return chunk_path(self.kv_dir, rel)

    # ------------------------------------------------------------------ sessions

    def open_session(
        self, session_id: str, *, fingerprint: str | None = None, system_prompt: str | None = None,
        create: bool = True,
    ) -> SessionInfo:
        """Open a session, creating it if missing (unless ``create=False``).

        An existing session is returned as is (its ``fingerprint`` is that of
        its KV; compare it and call :meth:`invalidate_kv` on a mismatch); its
        ``last_used_at`` is set to now. A new one records ``fingerprint`` and
        ``system_prompt``.

        Raises:
            InvalidSessionIdError, SessionNotFoundError (``create=False``),
            SessionLockedError (creating while another owner holds the id).
        """
        validate_session_id(session_id)
        for attempt in range(2):
            try:
                with self._tx() as s:
                    return self._open_row(s, session_id, fingerprint, system_prompt, create)
            except StorageWriteError:
                if attempt:  # a concurrent create won the insert; read it back
                    raise
        raise AssertionError("unreachable")

    def _open_row(self, s: Session, session_id: str, fingerprint: str | None, system_prompt: str | None,
                  create: bool) -> SessionInfo:
        """:meth:`open_session` in the transaction ``s``."""
        now = utcnow()
        if s.connection().execute(_TOUCH, {"sid": session_id, "now": now}).rowcount == 0:  # no such session
            if not create:
                raise SessionNotFoundError(f"no session {session_id!r}")
            self._check_lease(s, session_id)
            s.add(SessionRow(id=session_id, fingerprint=fingerprint, system_prompt=system_prompt,
                             created_at=now, updated_at=now, last_used_at=now, n_cached=0,
                             cached_ids=b"", kv_bytes=0, tier="none", kv_generation=0))
            s.flush()
        return self._session_info(s, session_id)

    def open_leased(self, session_id: str, *, fingerprint: str | None = None, system_prompt: str | None = None,
                    timeout_s: float = 0.0, on_wait: Callable[[str], None] | None = None) -> "LeasedSession":
        """Take the session's lease (as :meth:`acquire_lease`) and, in the
        transaction that takes it, open the session (as :meth:`open_session`,
        creating it if missing), read its messages (as :meth:`messages`) and,
        when it has KV made with ``fingerprint``, its chunk list (as
        :meth:`open_kv`): all that opening a session for new turns reads, as
        the lease found it, in one index transaction instead of four (on
        SQLite here, 4.4 -> 3.2 ms back to back). :meth:`release_lease` gives
        the lease back.

        Raises:
            InvalidSessionIdError; SessionLockedError: another live owner holds
            it past ``timeout_s``; StorageWriteError: the index failed.
        """
        validate_session_id(session_id)
        read: list[tuple[SessionInfo, list[MessageRecord], StoredKV | None]] = []

        def reads(s: Session) -> None:
            read.clear()  # an attempt that raced another taker starts again
            info = self._open_row(s, session_id, fingerprint, system_prompt, True)
            kv = None
            if info.n_cached and fingerprint is not None and info.fingerprint == fingerprint:
                kv = self._stored_kv(s, session_id, fingerprint)
            read.append((info, self._message_records(s, session_id), kv))

        lease = self.acquire_lease(session_id, timeout_s=timeout_s, on_wait=on_wait, within=reads)
        return LeasedSession(lease, *read[0])

    def get_session(self, session_id: str) -> SessionInfo:
        """Facts about one session, read in one query. Raises :class:`SessionNotFoundError`."""
        with self._tx(write=False) as s:
            return self._session_info(s, session_id)

    def has_session(self, session_id: str) -> bool:
        """True if the session exists."""
        with self._tx(write=False) as s:
            return s.get(SessionRow, validate_session_id(session_id)) is not None

    def list_sessions(self) -> list[SessionInfo]:
        """All sessions, most recently used first, read in one query (no per-session round trips)."""
        with self._tx(write=False) as s:
            return _session_infos(s, schema=self._schema)

    def set_retention(self, session_id: str, *, pinned: bool | None = None,
                      kv_ttl_s: float | None | object = ...) -> SessionInfo:
        """Set how long the session's KV is kept, in one transaction, and return its facts.

        ``pinned`` (None: unchanged) keeps its KV resident however long it idles:
        gc never expires it by TTL and drops it for the disk budget only after
        every unpinned session. ``kv_ttl_s`` (left out: unchanged; None: the
        store-wide TTL again) expires its KV after that many idle seconds,
        overriding the TTL gc is given. Needs no lease (it changes neither
        history nor KV), so it works while another process uses the session.

        Raises:
            SessionNotFoundError; ValueError: a negative TTL; StorageWriteError.
        """
        if kv_ttl_s is not ... and kv_ttl_s is not None:
            kv_ttl_s = float(kv_ttl_s)  # type: ignore[arg-type]
            if not kv_ttl_s >= 0:
                raise ValueError(f"kv_ttl_s must be >= 0 or None, not {kv_ttl_s!r}")
        with self._tx() as s:
            row = self._get(s, session_id)
            if pinned is not None:
                row.pinned = bool(pinned)
            if kv_ttl_s is not ...:
                row.kv_ttl_s = kv_ttl_s  # type: ignore[assignment]
        return self.get_session(session_id)

    def touch(self, session_id: str, *, tier: str | None = None) -> None:
        """Set ``last_used_at`` to now and, if given, the session's ``tier`` label (opaque to storage).

        Raises:
            SessionNotFoundError, SessionLockedError (LeaseLostError for a holder that lost it).
        """
        with self._tx() as s:
            row = self._get(s, session_id)
            self._check_lease(s, session_id)
            row.last_used_at = utcnow()
            if tier is not None:
                row.tier = tier

    def delete_session(self, session_id: str) -> RemoveResult:
        """Delete a session, its messages and its KV links, in one transaction.

        Chunk files no other session references are then removed from disk
        (not left for gc). Releases this Store's lease on it, if held.

        Raises:
            SessionNotFoundError, SessionLockedError.
        """
        with self._tx() as s:
            row = self._get(s, session_id)
            self._check_lease(s, session_id)
            hashes = set(s.scalars(select(SessionChunkRow.chunk_hash).where(SessionChunkRow.session_id == row.id)))
            s.execute(delete(SessionChunkRow).where(SessionChunkRow.session_id == row.id))
            s.execute(delete(MessageRow).where(MessageRow.session_id == row.id))
            s.execute(delete(LeaseRow).where(LeaseRow.session_id == row.id))
            s.delete(row)
            s.flush()
            dead = self._drop_unreferenced(s, hashes)
        with self._lock:
            lease = self._leases.pop(session_id, None)
        if lease is not None:
            lease.detach()  # its row went with the session
        return self._unlink_if_unindexed(dead)

    # ------------------------------------------------------------------ history

    def append_message(
        self, session_id: str, role: str, content: str, token_span: tuple[int, int] | None = None,
        *, partial: bool = False,
    ) -> MessageRecord:
        """Append one message to the session's history and commit it.

        Args:
            token_span: ``(start, end)`` of the message in the session's token ids, if known.
            partial: the message is a reply cut short (e.g. by Ctrl-C).

        Raises:
            SessionNotFoundError, SessionLockedError, StorageWriteError.
        """
        return self.append_messages(session_id, [(role, content, token_span, partial)])[0]

    def append_messages(self, session_id: str, messages: Sequence[MessageTuple]) -> list[MessageRecord]:
        """Append ``(role, content, token_span, partial[, outside_window])`` messages in one transaction.

        Either all of them are committed or none is.

        Raises:
            SessionNotFoundError, SessionLockedError, StorageWriteError.
        """
        return self.rewrite_history(session_id, None, messages)

    def messages(self, session_id: str) -> list[MessageRecord]:
        """The session's history, in order."""
        with self._tx(write=False) as s:
            return self._message_records(s, session_id)

    def _message_records(self, s: Session, session_id: str) -> list[MessageRecord]:
        """:meth:`messages` in the transaction ``s``."""
        conn = s.connection()
        sid = validate_session_id(session_id)
        rows = conn.execute(_MESSAGE_LIST, {"sid": sid}).all()
        if not rows:
            _check_exists(conn, sid)
        return [MessageRecord(idx, role, content,
                              (start, end) if start is not None and end is not None else None,
                              created_at, bool(flags & MESSAGE_PARTIAL), bool(flags & MESSAGE_OUTSIDE_WINDOW))
                for idx, role, content, start, end, created_at, flags in rows]

    def truncate_history(self, session_id: str, keep: int) -> int:
        """Delete messages with index >= ``keep`` (for undo/regenerate); return how many went.

        The KV is left alone: the caller re-saves it (a shorter prefix) if needed.
        """
        with self._tx() as s:
            row = self._get(s, session_id)
            self._check_lease(s, session_id)
            res = s.execute(delete(MessageRow).where(MessageRow.session_id == row.id, MessageRow.idx >= keep))
            n = getattr(res, "rowcount", 0)
            row.updated_at = utcnow()
            return int(n or 0)

    def rewrite_history(self, session_id: str, keep: int | None,
                        messages: Sequence[MessageTuple]) -> list[MessageRecord]:
        """Keep the first ``keep`` messages (all of them with None) and replace the
        rest with ``messages`` (``(role, content, token_span, partial[,
        outside_window])``), in ONE transaction: a crash or a full disk leaves
        either the old history or the new one, never a mix or none (rewind,
        edit, a new system prompt, reset).

        Raises:
            SessionNotFoundError, SessionLockedError, StorageWriteError.
        """
        if keep is not None and keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        for _, _, span, *_ in messages:
            if span is not None and not (0 <= span[0] <= span[1]):
                raise ValueError(f"bad token span {span}")
        with self._tx() as s:
            row = self._get(s, session_id)
            self._check_lease(s, session_id)
            if keep is not None:
                s.execute(delete(MessageRow).where(MessageRow.session_id == row.id, MessageRow.idx >= keep))
                s.flush()
            last = s.scalar(select(func.max(MessageRow.idx)).where(MessageRow.session_id == row.id))
            idx = 0 if last is None else last + 1
            now = utcnow()
            out = []
            for role, content, span, partial, *rest in messages:
                outside = bool(rest and rest[0])
                s.add(MessageRow(session_id=row.id, idx=idx, role=role, content=content,
                                 tok_start=span[0] if span else None, tok_end=span[1] if span else None,
                                 created_at=now, flags=_flags(partial, outside)))
                out.append(MessageRecord(idx, role, content, span, now, partial, outside))
                idx += 1
            row.updated_at = row.last_used_at = now
            return out

    # ------------------------------------------------------------------ chunks

    def write_chunk(
        self, token_ids: Sequence[int], tensors: Mapping[str, torch.Tensor], meta: ChunkMeta,
        *, parent: ChunkHash | None = None,
    ) -> ChunkInfo:
        """Write one chunk file (atomically, durably) unless it already exists.

        The hash is ``chunk_hash(parent, token_ids, meta.fingerprint, meta.kv_format)``.
        No index row is written here: :meth:`save_kv` commits it. The file is
        first recorded as pending for this Store (so if the process dies
        before the commit, the next Store to open removes it at once). An
        existing file is not rewritten (dedup; ``written == 0``) but its mtime
        is refreshed so gc's grace period protects it until the commit (which
        rewrites it from the payload if no row names it: see :meth:`save_kv`).

        Raises:
            StorageWriteError: disk full, read-only home, I/O error (no temp file left).
        """
        ids = [int(t) for t in token_ids]
        h = chunk_hash(parent, ids, meta.fingerprint, meta.kv_format)
        return self._write_file(h, parent, ids, tensors, meta, self._note_pending([h]).get(h))

    def _write_file(self, h: ChunkHash, parent: ChunkHash | None, ids: list[int],
                    tensors: Mapping[str, torch.Tensor], meta: ChunkMeta, indexed_bytes: int | None) -> ChunkInfo:
        rel = chunk_relpath(h)
        path = chunk_path(self.kv_dir, rel)
        try:
            st = path.stat()
            if indexed_bytes is None or st.st_size == indexed_bytes:
                os.utime(path)
                return ChunkInfo(h, parent, rel, len(ids), st.st_size, meta.fingerprint, meta.kv_format,
                                 meta.quant, meta.dtype, int(meta.block_size), 0)
        except FileNotFoundError:  # not on disk yet: write it below
            pass
        data = encode_chunk(h, parent, ids, tensors, meta)
        atomic_write(path, data, token=self.token)
        self.bytes_written += len(data)
        return ChunkInfo(h, parent, rel, len(ids), len(data), meta.fingerprint, meta.kv_format,
                         meta.quant, meta.dtype, int(meta.block_size), len(data))

    def _note_pending(self, hashes: Sequence[str]) -> dict[str, int]:
        """Record ``hashes`` as files this Store may leave unindexed; return the indexed ones' sizes.

        One transaction, before any of the files is written.
        """
        if not hashes:
            return {}
        wanted = set(hashes)
        with self._tx() as s:
            sizes = {h: int(b) for h, b in s.execute(select(ChunkRow.hash, ChunkRow.bytes)
                                                      .where(ChunkRow.hash.in_(wanted)))}
            self._add_pending(s, wanted)
        return sizes

    def _add_pending(self, s: Session, hashes: Iterable[str]) -> None:
        wanted = set(hashes)
        have = set(s.scalars(select(PendingFileRow.chunk_hash).where(
            PendingFileRow.token == self.token, PendingFileRow.chunk_hash.in_(wanted))))
        now = utcnow()
        s.add_all(PendingFileRow(token=self.token, chunk_hash=h, created_at=now) for h in sorted(wanted - have))

    def has_chunk(self, h: str) -> bool:
        """True if an index row names chunk ``h``."""
        with self._tx(write=False) as s:
            return s.get(ChunkRow, h) is not None

    def read_chunk(self, h: str, *, fingerprint: str | None = None, verify: bool = True) -> ChunkFile:
        """Read and verify an indexed chunk.

        On failure the file is quarantined and sessions using it are cut back to
        the chunks before it (see :meth:`quarantine_chunk`).

        Raises:
            MissingChunkError: no row, or no file.
            CorruptChunkError: the file failed verification.
        """
        with self._tx(write=False) as s:
            row = s.get(ChunkRow, h)
            info = _info(row) if row is not None else None
        if info is None:
            raise MissingChunkError(h, "no such chunk in the index")
        with self._quarantined_on_failure(info):
            return read_chunk_file(self.path_of(info), info.hash, expected_bytes=info.bytes,
                                   fingerprint=fingerprint, verify=verify)

    @contextmanager
    def _quarantined_on_failure(self, info: ChunkInfo) -> Iterator[None]:
        """A read of chunk ``info`` that fails verification quarantines it (the
        error re-raised with the sessions it cut); a missing chunk directory is
        reported as such and cuts nobody's KV."""
        try:
            yield
        except CorruptChunkError as e:
            if isinstance(e, MissingChunkError) and not self.kv_dir.is_dir():
                # Not a lost file but a missing directory (a server not given the
                # shared CHATKV_KV_DIR, an unmounted volume): cut nobody's KV for it.
                log.warning("chunk directory %s does not exist: is CHATKV_KV_DIR set as on the "
                            "other servers sharing %s?", self.kv_dir, self.db_url)
                raise MissingChunkError(info.hash, f"the chunk directory {self.kv_dir} does not exist "
                                        "(CHATKV_KV_DIR unset or not mounted?)") from e
            e.sessions = self.quarantine_chunk(info.hash, e.reason)
            raise

    def quarantine_chunk(self, h: str, reason: str = "") -> tuple[str, ...]:
        """Move chunk ``h``'s file to ``<home>/quarantine/`` and drop its rows.

        Every session that used it keeps only its chunks before the first use
        (``n_cached`` and cached token ids shrink to match); chunks that become
        unreferenced are removed. Messages are untouched. Returns the ids of the
        sessions whose KV shrank.
        """
        src = self.path_of(h)
        where = "no file"
        if src.exists():
            ensure_dir(self.quarantine_dir)
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
            dest = self.quarantine_dir / f"{h}.{stamp}{CHUNK_SUFFIX}"
            try:
                os.replace(src, dest)
                where = f"moved to {dest}"
            except OSError as e:
                where = f"could not move it ({e}); deleted"
                try:
                    src.unlink()
                except FileNotFoundError:
                    pass
                except OSError as e2:
                    where = f"could neither move nor delete it ({e}; {e2})"
        with self._tx() as s:
            users = s.execute(select(SessionChunkRow.session_id, func.min(SessionChunkRow.position))
                              .where(SessionChunkRow.chunk_hash == h).group_by(SessionChunkRow.session_id)).all()
            dropped: set[str] = {h}
            for sid, pos in users:
                sess = s.get(SessionRow, sid)
                assert sess is not None
                links = s.execute(select(SessionChunkRow.position, ChunkRow.hash, ChunkRow.n_tokens, ChunkRow.bytes)
                                  .join(ChunkRow, ChunkRow.hash == SessionChunkRow.chunk_hash)
                                  .where(SessionChunkRow.session_id == sid).order_by(SessionChunkRow.position)).all()
                kept = [l for l in links if l.position < pos]
                dropped.update(l.hash for l in links if l.position >= pos)
                s.execute(delete(SessionChunkRow).where(SessionChunkRow.session_id == sid,
                                                        SessionChunkRow.position >= pos))
                n = sum(l.n_tokens for l in kept)
                sess.cached_ids = sess.cached_ids[: 4 * n]
                sess.n_cached = n
                sess.kv_bytes = sum(l.bytes for l in kept)
                sess.kv_generation += 1
                sess.updated_at = utcnow()
            s.flush()
            dead = self._drop_unreferenced(s, dropped)
        self._unlink_if_unindexed([d for d in dead if d[0] != h])
        cut = tuple(sorted(u[0] for u in users))
        log.warning("quarantined KV chunk %s (%s): %s; sessions cut back to the chunks before it: %s",
                    h[:16], reason or "no reason given", where, ", ".join(cut) or "none")
        return cut

    # ------------------------------------------------------------------ KV

    def save_kv(
        self, session_id: str, *, token_ids: Sequence[int], fingerprint: str,
        chunks: Sequence[ChunkHash | str | ChunkInfo | NewChunk],
    ) -> SaveResult:
        """Replace the session's KV with ``chunks``, which cover exactly ``token_ids``, in one transaction.

        ``chunks`` is the session's whole ordered list: hashes or infos of
        chunks already written (e.g. the unchanged prefix), and/or
        :class:`NewChunk` payloads written here first (deduplicated). The last
        one may be partial (the tail). Each chunk's hash must chain:
        ``chunk_hash(previous hash, its slice of token_ids, fingerprint, kv_format)``.
        Files are durable before the commit; chunks that lose their last
        reference are removed from disk after it; if the commit fails, the
        files this call wrote are removed again. The KV is the engine's own,
        so its chunks are verified: a new chunk whose file exists without a
        row, or whose row only an import vouches for, is written again from
        the payload rather than reused.

        Raises:
            ValueError: the chunks do not chain over ``token_ids`` or fingerprints differ.
            MissingChunkError: a referenced chunk is neither indexed nor on disk.
            SessionNotFoundError, SessionLockedError, StorageWriteError.
        """
        ids = [int(t) for t in token_ids]
        validate_session_id(session_id)
        prep = self._write_chunks(ids, fingerprint, chunks)
        try:
            with self._tx() as s:
                row = self._get(s, session_id)
                self._check_lease(s, session_id)
                rewritten = self._index_chunks(s, prep)
                s.flush()
                dead = self._set_links(s, row, prep.infos, ids, fingerprint)
                gen = row.kv_generation
        except BaseException:
            self._discard(prep)
            raise
        removed = self._unlink_if_unindexed(dead)
        return SaveResult(session_id, gen, len(ids), prep.infos, prep.written + rewritten, prep.files_written,
                          removed.files_removed, removed.bytes_removed)

    def create_session(
        self, session_id: str, *, fingerprint: str | None = None, system_prompt: str | None = None,
        created_at: datetime | None = None, messages: Sequence[NewMessage] = (),
        token_ids: Sequence[int] = (), chunks: Sequence[ChunkHash | str | ChunkInfo | NewChunk] = (),
        replace: bool = False, kv_verified: bool = True,
    ) -> SessionInfo:
        """Create a session with its whole history and KV in one transaction (what an import needs).

        ``messages`` get indexes 0, 1, ... in order. ``chunks`` cover exactly
        ``token_ids``, as in :meth:`save_kv` (with ``fingerprint``); their
        files are written first (deduplicated), then the session row, its
        messages, chunk rows and links commit together: a failure leaves no
        part of the session. With ``replace``, an existing session of that id
        is replaced within the same transaction (this Store's lease on it, if
        any, stays), and its chunk files no other session uses are removed
        after the commit. If the commit fails, the files this call wrote are
        removed again and the old session, if any, is untouched.

        With ``kv_verified=False`` (an import) the new chunks' rows say only
        an import vouches for them: the session reports ``kv_verified`` False
        until :meth:`mark_kv_verified`, and a later :meth:`save_kv` of the same
        chunk by the engine replaces its file instead of reusing it. A chunk
        already indexed is reused as it is (its tensors are the engine's).

        Raises:
            SessionExistsError: the id exists and ``replace`` is false (checked
                before any file is written, and again in the transaction).
            ValueError: the chunks do not chain over ``token_ids``, fingerprints
                differ, or a token span is malformed.
            InvalidSessionIdError, SessionLockedError, MissingChunkError, StorageWriteError.
        """
        validate_session_id(session_id)
        ids = [int(t) for t in token_ids]
        for m in messages:
            if m.token_span is not None and not (0 <= m.token_span[0] <= m.token_span[1]):
                raise ValueError(f"bad token span {m.token_span}")
        if chunks and fingerprint is None:
            raise ValueError("chunks need the fingerprint they were made under")
        if not replace and self.has_session(session_id):
            raise SessionExistsError(f"session {session_id!r} exists")
        with self._tx(write=False) as s:
            self._check_lease(s, session_id)  # before writing any file
        prep = self._write_chunks(ids, fingerprint or "", chunks, trusted=kv_verified)
        try:
            dead = self._commit_session(session_id, prep, ids, fingerprint=fingerprint, system_prompt=system_prompt,
                                        created_at=created_at, messages=messages, replace=replace)
        except BaseException:
            self._discard(prep)
            raise
        self._unlink_if_unindexed(dead)
        return self.get_session(session_id)

    def _commit_session(self, session_id: str, prep: _Prepared, ids: list[int], *, fingerprint: str | None,
                        system_prompt: str | None, created_at: datetime | None, messages: Sequence[NewMessage],
                        replace: bool) -> list[_Dead]:
        now = utcnow()
        with self._tx() as s:
            self._check_lease(s, session_id)
            old = s.get(SessionRow, session_id)
            if old is not None:
                if not replace:
                    raise SessionExistsError(f"session {session_id!r} exists")
                old_hashes = set(s.scalars(select(SessionChunkRow.chunk_hash)
                                           .where(SessionChunkRow.session_id == session_id)))
                s.execute(delete(SessionChunkRow).where(SessionChunkRow.session_id == session_id))
                s.execute(delete(MessageRow).where(MessageRow.session_id == session_id))
                s.delete(old)
                s.flush()
            else:
                old_hashes = set()
            row = SessionRow(id=session_id, fingerprint=fingerprint, system_prompt=system_prompt,
                             created_at=created_at or now, updated_at=now, last_used_at=now, n_cached=0,
                             cached_ids=b"", kv_bytes=0, tier="none", kv_generation=0)
            s.add(row)
            s.flush()  # the session row before its messages (no ORM relationships to order them)
            for n, m in enumerate(messages):
                span = m.token_span
                s.add(MessageRow(session_id=session_id, idx=n, role=m.role, content=m.content,
                                 tok_start=span[0] if span else None, tok_end=span[1] if span else None,
                                 created_at=m.created_at or now, flags=_flags(m.partial, m.outside_window)))
            self._index_chunks(s, prep)
            s.flush()
            if prep.infos:
                self._set_links(s, row, prep.infos, ids, fingerprint)
            return self._drop_unreferenced(s, old_hashes - {i.hash for i in prep.infos})

    def _write_chunks(self, ids: list[int], fingerprint: str,
                      chunks: Sequence[ChunkHash | str | ChunkInfo | NewChunk], *, trusted: bool = True) -> _Prepared:
        """Check that ``chunks`` chain over ``ids`` and write the new ones' files (before any commit).

        Everything is checked before the first file is written; the new files
        are recorded as pending for this Store first. If a write fails, the
        files already written are removed again.
        """
        prep = _Prepared(trusted=trusted)
        plan: list[tuple[ChunkInfo | NewChunk, list[int], ChunkHash, ChunkHash | None]] = []
        parent: ChunkHash | None = None
        off = 0
        for c in chunks:
            if isinstance(c, NewChunk):
                if c.meta.fingerprint != fingerprint:
                    raise ValueError(f"chunk fingerprint {c.meta.fingerprint!r} != {fingerprint!r}")
                piece = ids[off: off + c.n_tokens]
                if len(piece) != c.n_tokens or c.n_tokens <= 0:
                    raise ValueError(f"chunk of {c.n_tokens} tokens does not fit at offset {off} of {len(ids)}")
                h = chunk_hash(parent, piece, fingerprint, c.meta.kv_format)
                plan.append((c, piece, h, parent))
            else:
                info = c if isinstance(c, ChunkInfo) else self._chunk_info(c)
                piece = ids[off: off + info.n_tokens]
                if info.fingerprint != fingerprint:
                    raise ValueError(f"chunk {info.hash[:12]} has fingerprint {info.fingerprint!r}, not {fingerprint!r}")
                if len(piece) != info.n_tokens or chunk_hash(parent, piece, fingerprint, info.kv_format) != info.hash:
                    raise ValueError(f"chunk {info.hash[:12]} does not match token_ids[{off}:{off + info.n_tokens}]")
                if info.parent != parent:
                    raise ValueError(f"chunk {info.hash[:12]} does not chain from {parent}")
                h = info.hash
                plan.append((info, piece, h, parent))
            parent = h
            off += len(piece)
        if off != len(ids):
            raise ValueError(f"chunks cover {off} tokens but token_ids has {len(ids)}")
        indexed = self._note_pending([h for c, _, h, _ in plan if isinstance(c, NewChunk)])
        try:
            for c, piece, h, parent in plan:
                if isinstance(c, NewChunk):
                    info = self._write_file(h, parent, piece, c.tensors, c.meta, indexed.get(h))
                    prep.payload[h] = (piece, c)
                    prep.written += info.written
                    prep.files_written += info.written > 0
                else:
                    info = c
                prep.infos.append(info)
        except BaseException:
            self._discard(prep)
            raise
        return prep

    def _index_chunks(self, s: Session, prep: _Prepared) -> int:
        """Add rows for ``prep``'s chunks not indexed yet; return bytes of files rewritten.

        Runs in the commit's transaction (under the write lock). A new chunk's
        file is written again from its payload when it vanished since (another
        session's cleanup unlinked it while it had no row), when it was there
        already without a row (a leftover of unknown origin: a crash, a failed
        import) or, for the engine's own KV, when its row says only an import
        vouches for it; so the commit never names a missing or foreign file.
        Rows of files rewritten for the engine become verified. ``prep.infos``
        are updated to the indexed facts, and this Store's pending records of
        them are cleared.
        """
        rewritten = 0
        final: list[ChunkInfo] = []
        for info in prep.infos:
            row = s.get(ChunkRow, info.hash)
            pay = prep.payload.get(info.hash)
            if row is None:
                if pay is not None and (info.written == 0 or not self.path_of(info).exists()):
                    info = self._rewrite(info, pay)
                    rewritten += info.bytes
                elif not self.path_of(info).exists():
                    raise MissingChunkError(info.hash, "file vanished before the commit")
                info = replace(info, verified=prep.trusted)
                s.add(chunk_row(info))
            else:
                if pay is not None and (info.written or (prep.trusted and not row.verified)):
                    if not info.written:
                        info = self._rewrite(info, pay)
                        rewritten += info.bytes
                    row.bytes = info.bytes
                    row.verified = prep.trusted
                info = replace(info, bytes=row.bytes, verified=bool(row.verified))
            final.append(info)
        prep.infos = final
        s.execute(delete(PendingFileRow).where(PendingFileRow.token == self.token,
                                               PendingFileRow.chunk_hash.in_([i.hash for i in final])))
        return rewritten

    def _rewrite(self, info: ChunkInfo, payload: tuple[list[int], NewChunk]) -> ChunkInfo:
        piece, c = payload
        data = encode_chunk(info.hash, info.parent, piece, c.tensors, c.meta)
        atomic_write(self.path_of(info), data, token=self.token)
        self.bytes_written += len(data)
        return replace(info, bytes=len(data), written=len(data))

    def _discard(self, prep: _Prepared) -> None:
        """After a failed save: remove the files it wrote that nothing indexed, and its pending records."""
        if not prep.payload:
            return
        try:
            self._reap_pending({self.token}, hashes=set(prep.payload))
        except StorageError as e:  # they stay recorded as this Store's; close() or the next open removes them
            log.warning("could not remove the chunk files of a failed save now: %s", e)

    def _chunk_info(self, h: str) -> ChunkInfo:
        with self._tx(write=False) as s:
            row = s.get(ChunkRow, h)
            if row is not None:
                return _info(row)
        # Written by write_chunk but not committed yet: its file's metadata says the rest.
        path = self.path_of(h)
        try:
            md = read_safetensors_metadata(path)
            return ChunkInfo(ChunkHash(h), ChunkHash(md["parent"]) if md.get("parent") else None, chunk_relpath(ChunkHash(h)),
                             int(md["n_tokens"]), path.stat().st_size, md["fingerprint"], md["kv_format"],
                             md["quant"], md["dtype"], int(md["block_size"]))
        except FileNotFoundError:
            raise MissingChunkError(h, "no such chunk in the index or on disk; write it first") from None
        except (OSError, ValueError, KeyError) as e:
            raise CorruptChunkError(h, f"unreadable metadata ({e})") from e

    def _set_links(self, s: Session, row: SessionRow, infos: Sequence[ChunkInfo], ids: Sequence[int],
                   fingerprint: str | None) -> list[_Dead]:
        old = set(s.scalars(select(SessionChunkRow.chunk_hash).where(SessionChunkRow.session_id == row.id)))
        s.execute(delete(SessionChunkRow).where(SessionChunkRow.session_id == row.id))
        s.add_all(SessionChunkRow(session_id=row.id, position=i, chunk_hash=info.hash) for i, info in enumerate(infos))
        now = utcnow()
        row.fingerprint = fingerprint if infos else row.fingerprint
        row.n_cached = len(ids)
        row.cached_ids = pack_token_ids(ids)
        row.kv_bytes = sum(i.bytes for i in infos)
        row.kv_generation += 1
        row.updated_at = row.last_used_at = now
        s.flush()
        return self._drop_unreferenced(s, old - {i.hash for i in infos})

    def _drop_unreferenced(self, s: Session, hashes: set[str]) -> list[_Dead]:
        """Delete rows of ``hashes`` that no session references; return their (hash, relpath).

        Their files are recorded as pending for this Store in the same
        transaction, so if it dies before :meth:`_unlink_if_unindexed` they
        are still known to be its leftovers.
        """
        if not hashes:
            return []
        still = set(s.scalars(select(SessionChunkRow.chunk_hash).where(SessionChunkRow.chunk_hash.in_(hashes))))
        dead = [(r.hash, r.relpath) for r in s.scalars(select(ChunkRow).where(ChunkRow.hash.in_(hashes - still)))]
        if dead:
            s.execute(delete(ChunkRow).where(ChunkRow.hash.in_([d[0] for d in dead])))
            self._add_pending(s, (d[0] for d in dead))
        return dead

    def _unlink_if_unindexed(self, dead: Sequence[_Dead]) -> RemoveResult:
        """Unlink files of dropped chunks, under the write lock, unless re-indexed meanwhile."""
        if not dead:
            return RemoveResult(0, 0)
        files = nbytes = 0
        try:
            with self._tx() as s:
                back = set(s.scalars(select(ChunkRow.hash).where(ChunkRow.hash.in_([d[0] for d in dead]))))
                for h, rel in dead:
                    if h in back:
                        continue
                    p = chunk_path(self.kv_dir, rel)
                    try:
                        size = p.stat().st_size
                        p.unlink()
                    except FileNotFoundError:
                        continue
                    except OSError as e:
                        log.warning("could not remove unreferenced chunk file %s (gc will retry): %s", p, e)
                        continue
                    log.debug("removed unreferenced chunk file %s (%d bytes)", p, size)
                    files += 1
                    nbytes += size
                s.execute(delete(PendingFileRow).where(PendingFileRow.token == self.token,
                                                       PendingFileRow.chunk_hash.in_([d[0] for d in dead])))
        except StorageError as e:  # the commit that dropped them stands; gc reclaims the files later
            log.warning("could not remove %d unreferenced chunk files now (gc will): %s", len(dead), e)
        return RemoveResult(files, nbytes)

    # ------------------------------------------------------------------ chunk index (for gc)

    def chunk_usage(self) -> list[ChunkUsage]:
        """Every indexed chunk with its number of session links, read in one query, by hash.

        Index facts only (no file access). ``n_refs == 0`` marks a chunk no
        session uses; :meth:`drop_unreferenced_chunks` removes those.
        """
        refs = (select(func.count()).select_from(SessionChunkRow)
                .where(SessionChunkRow.chunk_hash == ChunkRow.hash).correlate(ChunkRow).scalar_subquery())
        with self._tx(write=False) as s:
            rows = s.execute(select(ChunkRow.hash, ChunkRow.relpath, ChunkRow.bytes, refs).order_by(ChunkRow.hash))
            return [ChunkUsage(ChunkHash(h), rel, int(b), int(n or 0)) for h, rel, b, n in rows]

    def drop_unreferenced_chunks(self, hashes: Iterable[str]) -> RemoveResult:
        """Delete the index rows of those ``hashes`` that no session references, then their files.

        A hash some session uses (again) is left alone, as is one not indexed.
        Rows go in one transaction; files are unlinked after the commit, under
        the write lock, unless a save re-indexed them meanwhile (as every
        removal in this module). Returns what was removed from disk.

        Raises:
            StorageWriteError: the index transaction failed (nothing changed).
        """
        wanted = {str(h) for h in hashes}
        if not wanted:
            return RemoveResult(0, 0)
        with self._tx() as s:
            dead = self._drop_unreferenced(s, wanted)
        return self._unlink_if_unindexed(dead)

    def kv_chunks(self, session_id: str) -> list[ChunkInfo]:
        """The session's ordered chunk list (index facts only; no file access)."""
        sid = validate_session_id(session_id)
        with self._tx(write=False) as s:
            conn = s.connection()
            chunks = [_info(r) for r in conn.execute(_CHUNK_LIST, {"sid": sid})]
            if not chunks:
                _check_exists(conn, sid)
            return chunks

    def cached_token_ids(self, session_id: str) -> list[int]:
        """The token ids the session's KV covers (``tokens[:n_cached]``)."""
        with self._tx(write=False) as s:
            return unpack_token_ids(self._get(s, session_id).cached_ids)

    def iter_kv(self, session_id: str, *, fingerprint: str | None = None, verify: bool = True) -> Iterator[LoadedChunk]:
        """Yield the session's chunks in order, each read and verified as it is reached.

        Lets a caller move chunk ``i`` to the device while chunk ``i + 1`` loads.

        Raises:
            FingerprintMismatchError: the KV belongs to another fingerprint (nothing is read).
            CorruptChunkError / MissingChunkError: after quarantining (see :meth:`read_chunk`);
                chunks already yielded remain a valid prefix.
        """
        kv = self.open_kv(session_id, fingerprint=fingerprint)
        off = 0
        for info in kv.chunks:
            f = self.read_chunk(info.hash, fingerprint=fingerprint, verify=verify)
            self._check_chunk_tokens(info, f.token_ids, kv.token_ids[off: off + info.n_tokens])
            off += info.n_tokens
            yield LoadedChunk(info, f.token_ids, f.tensors)

    def open_kv(self, session_id: str, *, fingerprint: str | None = None) -> "StoredKV":
        """The session's stored KV as it is now (its token ids and ordered chunk
        list, read in one transaction), to read chunk by chunk straight into the
        caller's memory: iterating it opens each chunk in order
        (:class:`ChunkSource`). Nothing but the index is read here.

        Raises:
            FingerprintMismatchError: the KV belongs to another fingerprint.
            SessionNotFoundError: no such session.
        """
        with self._tx(write=False) as s:
            return self._stored_kv(s, session_id, fingerprint)

    def _stored_kv(self, s: Session, session_id: str, fingerprint: str | None) -> "StoredKV":
        """:meth:`open_kv` in the transaction ``s``."""
        conn = s.connection()
        sid = validate_session_id(session_id)
        row = conn.execute(_KV_ROW, {"sid": sid}).first()
        if row is None:
            raise SessionNotFoundError(f"no session {session_id!r}")
        row_fingerprint, n_cached, cached_ids = row
        if fingerprint is not None and n_cached and row_fingerprint != fingerprint:
            raise FingerprintMismatchError(session_id, row_fingerprint, fingerprint)
        chunks = [_info(r) for r in conn.execute(_CHUNK_LIST, {"sid": sid})]
        return StoredKV(self, session_id, fingerprint, unpack_token_ids(cached_ids), chunks)

    def _check_chunk_tokens(self, info: ChunkInfo, got: list[int], expected: list[int]) -> None:
        """Quarantine chunk ``info`` and raise unless its tokens are the session's ``expected`` ones."""
        if got != expected:
            sessions = self.quarantine_chunk(info.hash, "tokens differ from the session's")
            raise CorruptChunkError(info.hash, "tokens differ from the session's cached ids", sessions)

    def load_kv(self, session_id: str, *, fingerprint: str | None = None, verify: bool = True) -> SessionKV:
        """Read and verify the session's whole KV (see :meth:`iter_kv` for errors)."""
        chunks = list(self.iter_kv(session_id, fingerprint=fingerprint, verify=verify))
        ids = [t for c in chunks for t in c.token_ids]
        fp = chunks[0].info.fingerprint if chunks else None
        return SessionKV(validate_session_id(session_id), fp, ids, chunks)

    def invalidate_kv(self, session_id: str) -> RemoveResult:
        """Drop the session's KV (links, cached ids, fingerprint); keep its messages.

        For a fingerprint mismatch or any reason to re-prefill. Unshared chunk
        files are removed from disk.

        Raises:
            SessionNotFoundError, SessionLockedError.
        """
        with self._tx() as s:
            row = self._get(s, session_id)
            self._check_lease(s, session_id)
            dead = self._set_links(s, row, [], [], None)
            row.fingerprint = None
        return self._unlink_if_unindexed(dead)

    def mark_kv_verified(self, session_id: str, *, kv_generation: int | None = None) -> bool:
        """Record that the session's KV was checked against the model (e.g. a probe recomputed).

        Marks every chunk the session links as verified, so
        :attr:`SessionInfo.kv_verified` becomes True (for every session using
        those chunks). With ``kv_generation`` (the one the check read, from
        :meth:`get_session`), nothing changes if the KV was replaced since;
        returns whether it was marked.

        Raises:
            SessionNotFoundError, SessionLockedError, StorageWriteError.
        """
        with self._tx() as s:
            row = self._get(s, session_id)
            self._check_lease(s, session_id)
            if kv_generation is not None and row.kv_generation != kv_generation:
                return False
            mine = select(SessionChunkRow.chunk_hash).where(SessionChunkRow.session_id == row.id)
            s.execute(update(ChunkRow).where(ChunkRow.hash.in_(mine), ChunkRow.verified == false())
                      .values(verified=True))
            return True

    # ------------------------------------------------------------------ accounting

    def session_bytes(self, session_id: str) -> SessionBytes:
        """Disk bytes of the session's KV; ``unique`` counts chunks no other session uses."""
        with self._tx(write=False) as s:
            row = self._get(s, session_id)
            mine = select(SessionChunkRow.chunk_hash).where(SessionChunkRow.session_id == row.id)
            shared_hashes = set(s.scalars(select(SessionChunkRow.chunk_hash).where(
                SessionChunkRow.chunk_hash.in_(mine), SessionChunkRow.session_id != row.id)))
            sizes = s.execute(select(ChunkRow.hash, ChunkRow.bytes).join(
                SessionChunkRow, SessionChunkRow.chunk_hash == ChunkRow.hash).where(SessionChunkRow.session_id == row.id)).all()
        total = sum(b for _, b in sizes)
        shared = sum(b for h, b in sizes if h in shared_hashes)
        return SessionBytes(total, total - shared, shared)

    def disk_usage(self) -> DiskUsage:
        """Index totals, plus what is actually on disk under ``kv/`` and ``quarantine/``."""
        with self._tx(write=False) as s:
            n_chunks, indexed = s.execute(select(func.count(), func.coalesce(func.sum(ChunkRow.bytes), 0))).one()
        return disk_usage_of(int(n_chunks), int(indexed), self.kv_dir, self.quarantine_dir)

    # ------------------------------------------------------------------ leases

    def acquire_lease(self, session_id: str, *, timeout_s: float = 0.0, ttl_s: float | None = None,
                      auto_renew: bool = True, on_wait: Callable[[str], None] | None = None,
                      on_renew: Callable[[leases.Lease], None] | None = None,
                      on_lost: Callable[[LeaseLostError], None] | None = None,
                      within: Callable[[Session], None] | None = None) -> leases.Lease:
        """Take the session's lease for this Store's owner, waiting up to ``timeout_s``.

        Other owners' writes to the session then fail with
        :class:`SessionLockedError`, as does their ``acquire_lease``. A
        released or expired lease (by this Store's ``clock``), or one whose
        holder is provably gone (:func:`.leases.owner_is_dead`), is taken over;
        the new lease's generation is larger than any before it. From then on
        this Store's writes to the session are fenced by that generation: once
        the lease is lost (another owner took it after it lapsed) they raise
        :class:`LeaseLostError`, as do :meth:`Lease.renew` and
        :meth:`Lease.ensure`. A lease this Store held on the id before is
        superseded (its renewal stops). :meth:`close` releases it.

        Args:
            on_wait: called once with the holder's owner id if the lease is
                held and the call starts waiting for it.
            on_renew: called with the lease after each automatic renewal.
            on_lost: called once with the error when the lease is found lost.
            within: called in the transaction that takes the lease, before it
                commits (see :func:`.leases.acquire`).

        Raises:
            SessionLockedError: another live owner holds it past ``timeout_s``.
            StorageWriteError: the index failed.
        """
        validate_session_id(session_id)
        try:
            lease = leases.acquire(self._session, session_id, self.owner, ttl_s=ttl_s or self.lease_ttl_s,
                                   timeout_s=timeout_s, auto_renew=auto_renew, clock=self.clock,
                                   on_wait=on_wait, on_renew=on_renew, on_lost=on_lost, within=within)
        except SQLAlchemyError as e:
            raise StorageWriteError(f"index write failed: {e}") from e
        with self._lock:
            old, self._leases[session_id] = self._leases.get(session_id), lease
        if old is not None:
            old.detach()
        return lease

    def lease_holder(self, session_id: str) -> str | None:
        """The owner id of another live owner's lease on the session, or None if
        it is free (or held by this Store)."""
        with self._tx(write=False) as s:
            row = leases.foreign_holder(s, validate_session_id(session_id), self.owner, self.clock())
            return row.owner if row is not None else None

    def release_lease(self, session_id: str) -> None:
        """Release this Store's lease on ``session_id`` if it holds one (a lost
        one is only forgotten: its row belongs to the new holder). Never
        raises for the index: a release the index refuses (a database
        restarting) is logged, and the lease, no longer renewed, lapses at its
        expiry, as :meth:`close` leaves it. Closing a session whose turn was
        saved must not fail it: a client would send the turn again."""
        with self._lock:
            lease = self._leases.pop(session_id, None)
        if lease is None:
            return
        try:
            lease.release()
        except SQLAlchemyError as e:
            log.warning("could not release the lease on session %r (index: %s); it lapses at its expiry, "
                        "in %.0f s at most", session_id, e, lease.ttl_s)

    # ------------------------------------------------------------------ verification

    def verify_chunks(self) -> list[CorruptChunkError]:
        """Read and verify every indexed chunk; corrupt ones are quarantined and returned."""
        with self._tx(write=False) as s:
            hashes = list(s.scalars(select(ChunkRow.hash)))
        bad: list[CorruptChunkError] = []
        for h in hashes:
            if not self.has_chunk(h):  # dropped along with an earlier bad chunk
                continue
            try:
                self.read_chunk(h)
            except CorruptChunkError as e:
                bad.append(e)
        return bad


@dataclass(frozen=True)
class LeasedSession:
    """What :meth:`Store.open_leased` read under the lease it took.

    Attributes:
        lease: the session's lease, held by the Store.
        info: the session's facts, as :meth:`Store.open_session` returns them.
        messages: its history, in order.
        kv: its stored KV, as :meth:`Store.open_kv` returns it; None when it
            has no KV made with the fingerprint asked for.
    """

    lease: leases.Lease
    info: SessionInfo
    messages: list[MessageRecord]
    kv: "StoredKV | None"


@dataclass
class StoredKV:
    """A session's stored KV, from :meth:`Store.open_kv`: iterate it for its
    chunks in order, each opened (header and tokens checked) as it is reached.

    Attributes:
        session_id: the session.
        token_ids: the tokens its KV covers.
        chunks: its chunk list, in order.
    """

    store: "Store"
    session_id: str
    fingerprint: str | None
    token_ids: list[int]
    chunks: list[ChunkInfo]

    def __iter__(self) -> Iterator["ChunkSource"]:
        """Each chunk, opened (:meth:`open`), in order; a chunk that fails its
        checks is quarantined and its :class:`CorruptChunkError` (or
        :class:`MissingChunkError`) raised, the chunks before it remaining a
        valid prefix. Each source yielded holds its file open until it is read
        (:meth:`ChunkSource.read_into`, from any thread) or closed: the caller
        does one or the other."""
        for index in range(len(self.chunks)):
            yield self.open(index)

    def open(self, index: int) -> "ChunkSource":
        """Open chunk ``index`` of :attr:`chunks`: its file's header, fingerprint
        and token ids checked against the index and against this session's
        tokens at that place. Safe from any thread, and in any order (a restore
        opens its chunks in its reader threads); the source holds its file open
        until it is read or closed.

        Raises:
            CorruptChunkError, MissingChunkError: after quarantining the chunk.
            IndexError: no such chunk.
        """
        info = self.chunks[index]
        off = sum(c.n_tokens for c in self.chunks[:index])
        store = self.store
        with store._quarantined_on_failure(info):
            reader = open_chunk_file(chunk_file(str(store.kv_dir), info.relpath), info.hash,
                                     expected_bytes=info.bytes, fingerprint=self.fingerprint)
        try:
            store._check_chunk_tokens(info, reader.token_ids, self.token_ids[off: off + info.n_tokens])
        except BaseException:
            reader.close()
            raise
        return ChunkSource(store, info, reader)


class ChunkSource:
    """One opened chunk of a :class:`StoredKV`: its index facts, tokens and the
    tensors' shapes, read on demand into the caller's memory."""

    def __init__(self, store: "Store", info: ChunkInfo, reader: ChunkReader) -> None:
        """Made by :class:`StoredKV`."""
        self._store = store
        self._reader = reader
        self.info = info
        self.token_ids: list[int] = reader.token_ids
        self.shapes = reader.shapes

    def converts(self) -> bool:
        """Whether :meth:`read_into` can convert tensors as it reads them (see
        :meth:`~.chunkfile.ChunkReader.converts`)."""
        return self._reader.converts()

    def read_into(self, buffers: Mapping[str, Sequence[Any]],
                  converted: Mapping[str, Converted] | None = None) -> dict[str, Any]:
        """Read and verify the chunk's tensors, those named in ``buffers`` into
        those buffers and those named in ``converted`` converted into theirs
        (see :meth:`~.chunkfile.ChunkReader.read_into`); returns the others,
        read into new memory. Closes the file.

        Raises:
            CorruptChunkError: after quarantining the chunk; the caller's
                buffers then hold unverified bytes and must not be used.
            ValueError: ``buffers`` or ``converted`` do not fit the chunk's
                tensors (the chunk is not quarantined for that).
        """
        try:
            with self._store._quarantined_on_failure(self.info):
                return self._reader.read_into(buffers, converted=converted)
        finally:
            self._reader.close()

    def close(self) -> None:
        """Close the file without reading it (idempotent)."""
        self._reader.close()
