"""Engine construction: SQLite gets WAL, foreign keys, a busy timeout and real transactions."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import SQLAlchemyError

from .errors import StorageError


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
    issued: no journal mode change, and plain ``BEGIN``. Other backends are
    used as configured by their URL.
    """
    u = make_url(url)
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
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def open_read_only(url: str, home: Path) -> Engine:
    """An engine that reads the index at ``url`` without writing anything (a read-only ``home``).

    An SQLite file is opened with ``mode=ro``, or, where that cannot work (a
    WAL database whose ``-shm`` file is absent and cannot be created in a
    read-only directory), as ``immutable``: nobody can be writing it then.
    Other backends are opened as usual.

    Raises:
        StorageError: there is no index file, or it cannot be read.
    """
    path = sqlite_path(url)
    if path is None:
        return make_engine(url)
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
