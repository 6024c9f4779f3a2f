"""Engine construction: one writer at a time on every backend.

SQLite gets WAL, foreign keys, a busy timeout and ``BEGIN IMMEDIATE``;
PostgreSQL gets a transaction-scoped advisory lock taken first in every
transaction, the same single-writer rule (see :func:`make_engine`), a
connection pool sized for a server's threads, and a liveness check of each
pooled connection before use, so a restarted database costs no request.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import SQLAlchemyError

from .errors import StorageError

#: The key of the advisory lock every PostgreSQL transaction of chatkv takes
#: first (``pg_advisory_xact_lock``): a fixed 63-bit number ("chatkv.index").
PG_LOCK_KEY = 0x63686174_6B76_6978
#: Connections each engine keeps open (``CHATKV_DB_POOL_SIZE``), and how many
#: more it may open under load (``CHATKV_DB_MAX_OVERFLOW``): enough for
#: ``chatkv serve``'s 32 worker threads plus lease renewals and restores.
POOL_SIZE = 8
MAX_OVERFLOW = 40
#: A wait for another transaction's lock fails after this long (SQLite's busy timeout).
LOCK_TIMEOUT_S = 30
#: PostgreSQL ends a session idle inside a transaction this long (a stopped
#: process), so its lock cannot block every other server.
IDLE_IN_TRANSACTION_TIMEOUT_S = 20


def backend_name(url: str) -> str:
    """The SQLAlchemy backend of ``url``: ``sqlite``, ``postgresql``, ..."""
    return make_url(url).get_backend_name()


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if not v:
        return default
    try:
        return int(v)
    except ValueError:
        raise StorageError(f"{name} must be an integer, not {v!r}") from None


def sqlite_path(url: str) -> str | None:
    """The database file of a file-backed SQLite URL, else None (another backend, or in memory)."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:" \
            or u.database.startswith("file:"):
        return None
    return u.database


def read_only_url(path: str, *, immutable: bool = False) -> str:
    """A URL opening the SQLite file at ``path`` read-only (``mode=ro``), or as
    ``immutable`` (no locks, no ``-shm`` file: for a directory nobody can write)."""
    mode = "immutable=1" if immutable else "mode=ro"
    return f"sqlite:///file:{quote(path)}?{mode}&uri=true"


def make_engine(url: str, *, read_only: bool = False) -> Engine:
    """Create an SQLAlchemy engine for ``url``.

    For SQLite only, every connection gets ``foreign_keys=ON``, ``journal_mode=WAL``,
    ``synchronous=FULL`` and a 30 s busy timeout, and every transaction starts with
    ``BEGIN IMMEDIATE`` (pysqlite's own transaction handling would let DDL
    autocommit and let two writers deadlock on lock upgrade). With
    ``read_only`` (a URL from :func:`read_only_url`) nothing that writes is
    issued: no journal mode change, and plain ``BEGIN``.

    For PostgreSQL see :func:`_postgres_engine`. Other backends are used as
    configured by their URL, with a liveness check of pooled connections.

    Raises:
        StorageError: a pool size variable is not an integer.
    """
    u = make_url(url)
    if u.get_backend_name() == "postgresql":
        return _postgres_engine(url, read_only=read_only)
    if u.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"timeout": 30.0})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves, below
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        if not read_only:
            _enable_wal(cur)
            cur.execute("PRAGMA synchronous=FULL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def _enable_wal(cur: Any, timeout_s: float = 30.0) -> None:
    """Put the database in WAL mode (a no-op once it is: the mode is stored in the file).

    Switching needs an exclusive lock, and SQLite does not call its busy handler
    for it: a second process opening a new index while the first creates it
    gets "database is locked" at once. So the switch is retried, with a short
    growing pause, for up to ``timeout_s`` seconds.
    """
    import sqlite3
    import time

    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        try:
            if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.2)


def _postgres_engine(url: str, *, read_only: bool = False) -> Engine:
    """An engine for a PostgreSQL URL: writers serialize as on SQLite, and restarts are survived.

    - Every transaction first takes ``pg_advisory_xact_lock(PG_LOCK_KEY)``
      (released at its commit or rollback), then runs at READ COMMITTED, so
      each statement sees every transaction committed before the lock was
      granted: exactly SQLite's ``BEGIN IMMEDIATE`` rule, on which the
      Store's ordering (files fsynced before the row commits, unlinked after
      and only if still unreferenced, migrations applied once) relies.
    - ``lock_timeout`` is :data:`LOCK_TIMEOUT_S` and
      ``idle_in_transaction_session_timeout`` :data:`IDLE_IN_TRANSACTION_TIMEOUT_S`.
    - The pool keeps ``CHATKV_DB_POOL_SIZE`` (:data:`POOL_SIZE`) connections
      and opens up to ``CHATKV_DB_MAX_OVERFLOW`` (:data:`MAX_OVERFLOW`) more;
      each is pinged before use (``pool_pre_ping``), so connections the
      server dropped (a restart, a failover) are replaced instead of failing
      the next transaction. A transaction cut in the middle fails (and rolls
      back on the server), it is never half-committed.

    With ``read_only`` every transaction is ``READ ONLY`` (a write fails)
    at REPEATABLE READ (one snapshot per transaction) and takes no lock.
    """
    engine = create_engine(
        url, pool_pre_ping=True, pool_size=_env_int("CHATKV_DB_POOL_SIZE", POOL_SIZE),
        max_overflow=_env_int("CHATKV_DB_MAX_OVERFLOW", MAX_OVERFLOW), pool_timeout=60,
        connect_args={"connect_timeout": 10},
        **({"isolation_level": "REPEATABLE READ"} if read_only else {}),
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute(f"SET lock_timeout = '{LOCK_TIMEOUT_S}s'")
        cur.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION_TIMEOUT_S}s'")
        if read_only:
            cur.execute("SET default_transaction_read_only = on")
        cur.close()
        dbapi_conn.commit()  # a SET inside a rolled-back transaction would be undone

    if not read_only:
        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({PG_LOCK_KEY})")

    return engine


def open_read_only(url: str, home: Path) -> Engine:
    """An engine that reads the index at ``url`` without writing anything (a read-only ``home``).

    An SQLite file is opened with ``mode=ro``, or, where that cannot work (a
    WAL database whose ``-shm`` file is absent and cannot be created in a
    read-only directory), as ``immutable``: nobody can be writing it then.
    A PostgreSQL index is opened with read-only transactions. Other backends
    are opened as usual.

    Raises:
        StorageError: there is no index file, or it cannot be read.
    """
    path = sqlite_path(url)
    if path is None:
        return make_engine(url, read_only=make_url(url).get_backend_name() == "postgresql")
    if not os.path.isfile(path):
        raise StorageError(f"there is no chatkv index at {path}, and {home} is read-only "
                           "(nothing can be created there)")
    err: Exception | None = None
    for immutable in (False, True):
        engine = make_engine(read_only_url(path, immutable=immutable), read_only=True)
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").all()
            return engine
        except SQLAlchemyError as e:
            engine.dispose()
            err = e
    raise StorageError(f"cannot open the index {path} read-only: {err}")
