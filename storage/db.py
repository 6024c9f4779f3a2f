"""Engine construction: SQLite gets WAL, foreign keys, a busy timeout and real transactions."""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine, make_url


def make_engine(url: str) -> Engine:
    """Create an SQLAlchemy engine for ``url``.

    For SQLite only, every connection gets ``foreign_keys=ON``, ``journal_mode=WAL``,
    ``synchronous=FULL`` and a 30 s busy timeout, and every transaction starts with
    ``BEGIN IMMEDIATE`` (pysqlite's own transaction handling would let DDL
    autocommit and let two writers deadlock on lock upgrade). Other backends are
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
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine
