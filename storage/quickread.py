"""A read-only view of an SQLite index through the standard library's ``sqlite3``.

``chatkv sessions ls``, ``show`` and ``gc --dry-run`` only read the index, and
a user waits for them at a shell prompt. Importing SQLAlchemy's ORM alone
takes longer than such a command should (about 0.35 s of a 0.5 s budget on a
small machine), so for the common case, a file-backed SQLite index at the
schema versions this module was written for, they read it here instead:
one ``sqlite3`` connection opened ``mode=ro``, and the same queries as
:class:`~.store.Store`'s, returning the same records.

:func:`open_quick_reader` returns None whenever that case does not hold
(another backend, another schema version, no index yet, a home this process
cannot write, a database it cannot read); the caller then opens a
:class:`~.store.Store`, which handles all of them (it migrates, or opens a
read-only home). Nothing here writes: no migration, no lock file, no debris
removal.

:class:`QuickReader` has the read methods that :func:`~.gc.enforce_disk_policy`
and :func:`~.gc.collect_garbage` use in a dry run, so the same planning code
runs over either. ``tests/storage/test_quickread.py`` checks that every
method returns what :class:`~.store.Store`'s does on the same index.

Imports neither SQLAlchemy nor torch.
"""

from __future__ import annotations

import json
import os
import sqlite3
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

from .errors import SessionNotFoundError
from .hashing import ChunkHash
from .ids import validate_session_id
from .paths import (
    CHUNK_SUFFIX,
    QUARANTINE_DIR,
    TMP_PREFIX,
    chunk_path,
    chunk_relpath,
    default_db_url,
    default_home,
    default_kv_dir,
    file_size,
)
from .records import ChunkUsage, DiskUsage, MessageRecord, SessionBytes, SessionInfo

#: The schema versions these queries read (``migrations.LATEST_VERSION`` must be
#: among them: a test checks it); any other falls back to :class:`~.store.Store`.
SCHEMA_VERSIONS = (4, 5, 6, 7)  # v7 only widened two integer columns on PostgreSQL

#: ``chatkv_meta`` key of the lost-index record (``schema.META_INDEX_LOST``).
_META_INDEX_LOST = "index_lost"
_MESSAGE_PARTIAL = 1
_MESSAGE_OUTSIDE_WINDOW = 2

_INFO_SQL = """
SELECT s.id, s.fingerprint, s.system_prompt, s.created_at, s.updated_at, s.last_used_at, s.n_cached,
       (SELECT count(*) FROM chatkv_messages m WHERE m.session_id = s.id),
       (SELECT count(*) FROM chatkv_messages m WHERE m.session_id = s.id AND m.role = 'user'),
       (SELECT count(*) FROM chatkv_session_chunks c WHERE c.session_id = s.id),
       s.kv_bytes, s.tier, s.kv_generation,
       NOT EXISTS (SELECT 1 FROM chatkv_session_chunks c JOIN chatkv_chunks k ON k.hash = c.chunk_hash
                   WHERE c.session_id = s.id AND k.verified = 0),
       {retention}
FROM chatkv_sessions s {where}
ORDER BY s.last_used_at DESC, s.id
"""


def sqlite_file(db_url: str) -> str | None:
    """The file of a plain file-backed SQLite URL (``sqlite:///path``), else None.

    Conservative: any URL this cannot read exactly as SQLAlchemy would (a
    driver suffix, a query string, an escape, ``file:`` URIs, memory
    databases, other backends) gives None, and the caller uses the Store.
    """
    prefix = "sqlite:///"
    if not db_url.startswith(prefix):
        return None
    path = db_url[len(prefix):]
    if not path or path == ":memory:" or path.startswith("file:") or "?" in path or "%" in path:
        return None
    return path


def _time(value: str | None) -> datetime:
    """A time column as SQLAlchemy's ``UTCDateTime`` returns it: aware UTC."""
    if value is None:
        raise ValueError("a NULL time in a NOT NULL column")
    return datetime.fromisoformat(value).replace(tzinfo=timezone.utc)


def lost_index_message(db_url: str, kv_dir: Path, why: str | None, n_files: int) -> str:
    """What :meth:`Store.index_lost` says when ``kv_dir`` holds ``n_files`` chunk files the index
    does not know (``why``: the recorded reason, or None when the index is merely empty)."""
    why = why or f"it has no sessions and no chunks while {kv_dir} holds {n_files} chunk files"
    return (f"the index at {db_url} looks lost: {why}. Those files may be all that is left of the "
            "conversations (their KV and token ids), so gc keeps them instead of deleting them as orphans. "
            "If the index was deleted or damaged, restore it from a backup first; if the sessions were "
            "removed on purpose, delete the files with `chatkv sessions gc --force` "
            "(collect_garbage(..., force=True)).")


def count_chunk_files(kv_dir: Path) -> int:
    """Finished chunk files in ``kv_dir``'s fan-out directories (not temp files, not through symlinked dirs)."""
    n = 0
    for sub in scandir(kv_dir):
        if sub.is_dir(follow_symlinks=False):
            n += sum(1 for e in scandir(Path(sub.path))
                     if e.name.endswith(CHUNK_SUFFIX) and not e.name.startswith(TMP_PREFIX))
    return n


def disk_usage_of(n_chunks: int, indexed_bytes: int, kv_dir: Path, quarantine_dir: Path) -> DiskUsage:
    """A :class:`DiskUsage` from the index's totals and what ``kv_dir`` and ``quarantine_dir`` hold now."""
    files = list(kv_dir.glob(f"*/*{CHUNK_SUFFIX}")) if kv_dir.exists() else []
    quar = list(quarantine_dir.iterdir()) if quarantine_dir.exists() else []
    return DiskUsage(n_chunks, indexed_bytes, len(files), sum(file_size(p) for p in files),
                     len(quar), sum(file_size(p) for p in quar))


def scandir(path: Path) -> list[os.DirEntry[str]]:
    """The entries of directory ``path``; none if it cannot be read."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


class QuickReader:
    """The read side of a :class:`~.store.Store` on an SQLite index, without SQLAlchemy.

    Methods return exactly what the Store's methods of the same names return.
    Not thread-safe (one connection); close it, or use it as a context manager.
    A lease is treated as live until its expiry, even where the Store could
    prove its holder dead and take it over: a dry run may keep a session a
    real gc would expire.
    """

    def __init__(self, home: Path, db_url: str, conn: sqlite3.Connection, schema: int) -> None:
        self.home = home
        self.db_url = db_url
        self.kv_dir = default_kv_dir(home)
        self.quarantine_dir = home / QUARANTINE_DIR
        self.read_only = True
        self._conn = conn
        self._schema = schema

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        """Close the connection. Idempotent."""
        self._conn.close()

    def __enter__(self) -> "QuickReader":
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def path_of(self, h: str) -> Path:
        """Absolute path of a chunk file, from its hash (as :meth:`Store.path_of`)."""
        return chunk_path(self.kv_dir, chunk_relpath(ChunkHash(h)))

    def _one(self, sql: str, *args: object) -> tuple | None:
        return self._conn.execute(sql, args).fetchone()

    def _require(self, session_id: str) -> str:
        sid = validate_session_id(session_id)
        if self._one("SELECT 1 FROM chatkv_sessions WHERE id = ?", sid) is None:
            raise SessionNotFoundError(f"no session {session_id!r}")
        return sid

    # ------------------------------------------------------------------ sessions

    def _infos(self, where: str = "", *args: object) -> list[SessionInfo]:
        retention = "s.pinned, s.kv_ttl_s" if self._schema >= 5 else "0, NULL"
        rows = self._conn.execute(_INFO_SQL.format(where=where, retention=retention), args)
        return [SessionInfo(r[0], r[1], r[2], _time(r[3]), _time(r[4]), _time(r[5]), int(r[6]),
                            int(r[7]), int(r[8]), int(r[9]), int(r[10]), r[11], int(r[12]), bool(r[13]),
                            bool(r[14]), None if r[15] is None else float(r[15]))
                for r in rows]

    def list_sessions(self) -> list[SessionInfo]:
        """All sessions, most recently used first (as :meth:`Store.list_sessions`)."""
        return self._infos()

    def get_session(self, session_id: str) -> SessionInfo:
        """Facts about one session. Raises :class:`SessionNotFoundError` (as :meth:`Store.get_session`)."""
        found = self._infos("WHERE s.id = ?", validate_session_id(session_id))
        if not found:
            raise SessionNotFoundError(f"no session {session_id!r}")
        return found[0]

    def has_session(self, session_id: str) -> bool:
        """True if the session exists."""
        return self._one("SELECT 1 FROM chatkv_sessions WHERE id = ?", validate_session_id(session_id)) is not None

    def messages(self, session_id: str) -> list[MessageRecord]:
        """The session's history, in order (as :meth:`Store.messages`)."""
        sid = self._require(session_id)
        rows = self._conn.execute(
            "SELECT idx, role, content, tok_start, tok_end, created_at, flags FROM chatkv_messages "
            "WHERE session_id = ? ORDER BY idx", (sid,))
        return [MessageRecord(idx, role, content, (a, b) if a is not None and b is not None else None,
                              _time(at), bool(flags & _MESSAGE_PARTIAL), bool(flags & _MESSAGE_OUTSIDE_WINDOW))
                for idx, role, content, a, b, at, flags in rows]

    # ------------------------------------------------------------------ accounting

    def session_bytes(self, session_id: str) -> SessionBytes:
        """Disk bytes of the session's KV (as :meth:`Store.session_bytes`)."""
        sid = self._require(session_id)
        rows = self._conn.execute(
            "SELECT k.bytes, EXISTS (SELECT 1 FROM chatkv_session_chunks o "
            "                        WHERE o.chunk_hash = c.chunk_hash AND o.session_id != c.session_id) "
            "FROM chatkv_session_chunks c JOIN chatkv_chunks k ON k.hash = c.chunk_hash WHERE c.session_id = ?",
            (sid,)).fetchall()
        total = sum(int(b) for b, _ in rows)
        shared = sum(int(b) for b, is_shared in rows if is_shared)
        return SessionBytes(total, total - shared, shared)

    def chunk_usage(self) -> list[ChunkUsage]:
        """Every indexed chunk with its number of session links, by hash (as :meth:`Store.chunk_usage`)."""
        rows = self._conn.execute(
            "SELECT k.hash, k.relpath, k.bytes, "
            "       (SELECT count(*) FROM chatkv_session_chunks c WHERE c.chunk_hash = k.hash) "
            "FROM chatkv_chunks k ORDER BY k.hash")
        return [ChunkUsage(ChunkHash(h), rel, int(b), int(n)) for h, rel, b, n in rows]

    def disk_usage(self) -> DiskUsage:
        """Index totals and what is on disk under ``kv/`` and ``quarantine/`` (as :meth:`Store.disk_usage`)."""
        n_chunks, indexed = self._one("SELECT count(*), coalesce(sum(bytes), 0) FROM chatkv_chunks") or (0, 0)
        return disk_usage_of(int(n_chunks), int(indexed), self.kv_dir, self.quarantine_dir)

    def index_lost(self) -> str | None:
        """Why the index looks lost, or None (as :meth:`Store.index_lost`, whose message it shares)."""
        marker = self._one("SELECT value FROM chatkv_meta WHERE key = ?", _META_INDEX_LOST)
        if marker is None:
            (n_sessions,) = self._one("SELECT count(*) FROM chatkv_sessions") or (0,)
            (n_chunks,) = self._one("SELECT count(*) FROM chatkv_chunks") or (0,)
            if n_sessions or n_chunks:
                return None
        n = count_chunk_files(self.kv_dir)
        if not n:
            return None
        why = json.loads(marker[0]).get("reason") if marker is not None else None
        return lost_index_message(self.db_url, self.kv_dir, why, n)

    # ------------------------------------------------------------------ leases

    def lease_holder(self, session_id: str) -> str | None:
        """The owner id of an unexpired lease on the session, or None.

        Unlike :meth:`Store.lease_holder`, a holder is not checked for being a
        dead process (this reader owns no lease and takes none over).
        """
        row = self._one("SELECT owner, expires_at FROM chatkv_leases WHERE session_id = ?",
                        validate_session_id(session_id))
        if row is None or _time(row[1]) <= datetime.now(timezone.utc):
            return None
        return str(row[0])


def open_quick_reader(home: str | os.PathLike[str] | None = None, db_url: str | None = None) -> QuickReader | None:
    """A :class:`QuickReader` on the index a default :class:`~.store.Store` would open, or None.

    None (open a Store instead) unless the index is a plain SQLite file that
    exists in a home this process can write, holds chatkv's tables at exactly
    one of :data:`SCHEMA_VERSIONS`, and opens read-only. Never creates or changes anything.
    """
    home_path = Path(home).expanduser() if home is not None else default_home()
    url = db_url or default_db_url(home_path)
    path = sqlite_file(url)
    if path is None or not os.path.isfile(path) or not os.access(home_path, os.W_OK) \
            or not os.access(path, os.R_OK | os.W_OK):
        return None  # a read-only home: the Store knows how to open it without writing
    try:
        conn = sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=ro", uri=True, timeout=30.0)
    except sqlite3.Error:
        return None
    try:
        row = conn.execute("SELECT max(version) FROM chatkv_schema").fetchone()
    except sqlite3.Error:
        conn.close()
        return None
    if row is None or row[0] not in SCHEMA_VERSIONS:
        conn.close()
        return None
    return QuickReader(home_path, url, conn, int(row[0]))
