from __future__ import annotations

from pathlib import Path

import pytest
from chatkv.storage import (
    SCHEMA_VERSION,
    SchemaVersionError,
    SessionNotFoundError,
    StorageError,
    StorageWriteError,
    Store,
    pack_token_ids,
)
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

from .conftest import FP, new_chunks

# The v1 schema exactly as chatkv 0.1 created it (written out by hand on purpose).
V1_DDL = """
CREATE TABLE chatkv_schema (version INTEGER PRIMARY KEY, description VARCHAR(200) NOT NULL, applied_at DATETIME NOT NULL);
CREATE TABLE chatkv_sessions (
    id VARCHAR(128) PRIMARY KEY, fingerprint VARCHAR(200), system_prompt TEXT,
    created_at DATETIME NOT NULL, updated_at DATETIME NOT NULL, last_used_at DATETIME NOT NULL,
    n_cached INTEGER NOT NULL, cached_ids BLOB NOT NULL, kv_bytes INTEGER NOT NULL, tier VARCHAR(32) NOT NULL);
CREATE TABLE chatkv_messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id VARCHAR(128) NOT NULL REFERENCES chatkv_sessions(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL, role VARCHAR(32) NOT NULL, content TEXT NOT NULL, tok_start INTEGER, tok_end INTEGER,
    created_at DATETIME NOT NULL, CONSTRAINT uq_chatkv_messages_session_idx UNIQUE (session_id, idx));
CREATE TABLE chatkv_chunks (
    hash VARCHAR(64) PRIMARY KEY, parent VARCHAR(64), relpath VARCHAR(255) NOT NULL, n_tokens INTEGER NOT NULL,
    bytes INTEGER NOT NULL, fingerprint VARCHAR(200) NOT NULL, kv_format VARCHAR(64) NOT NULL, quant VARCHAR(64) NOT NULL,
    dtype VARCHAR(32) NOT NULL, block_size INTEGER NOT NULL, created_at DATETIME NOT NULL);
CREATE TABLE chatkv_session_chunks (
    session_id VARCHAR(128) NOT NULL REFERENCES chatkv_sessions(id) ON DELETE CASCADE, position INTEGER NOT NULL,
    chunk_hash VARCHAR(64) NOT NULL REFERENCES chatkv_chunks(hash), PRIMARY KEY (session_id, position));
INSERT INTO chatkv_schema VALUES (1, 'sessions, messages, chunks, session_chunks', '2025-01-01 00:00:00');
"""


def _v1_ddl(engine: Engine) -> list[str]:
    """V1_DDL's statements in ``engine``'s dialect (PostgreSQL spells three types differently)."""
    ddl = V1_DDL
    if engine.dialect.name == "postgresql":
        ddl = (ddl.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "SERIAL PRIMARY KEY")
               .replace("DATETIME", "TIMESTAMP").replace("BLOB", "BYTEA"))
    return [st.strip() for st in ddl.split(";") if st.strip()]


def _make_v1(engine: Engine) -> None:
    with engine.begin() as con:
        for st in _v1_ddl(engine):
            con.execute(text(st))
        con.execute(text(
            "INSERT INTO chatkv_sessions VALUES ('old-1', 'fp-old', 'Be terse.', '2025-01-01 00:00:00',"
            " '2025-01-01 00:00:00', '2025-01-02 00:00:00', 3, :ids, 0, 'disk')"), {"ids": pack_token_ids([5, 6, 7])})
        con.execute(text("INSERT INTO chatkv_messages (session_id, idx, role, content, tok_start, tok_end, created_at)"
                         " VALUES ('old-1', 0, 'user', 'hello from v1', 0, 3, '2025-01-01 00:00:00')"))



def test_v1_database_is_upgraded_in_place_keeping_data(home: Path, index_engine: Engine) -> None:
    home.mkdir()
    _make_v1(index_engine)
    with Store(home) as st:
        with st.engine.connect() as c:
            versions = [r[0] for r in c.execute(text("SELECT version FROM chatkv_schema ORDER BY version"))]
            cols = {col["name"] for col in inspect(c).get_columns("chatkv_sessions")}
            tables = set(inspect(c).get_table_names())
        assert versions == list(range(1, SCHEMA_VERSION + 1)) and SCHEMA_VERSION >= 2
        assert "kv_generation" in cols and "chatkv_leases" in tables
        info = st.get_session("old-1")
        assert (info.fingerprint, info.system_prompt, info.n_cached, info.kv_generation) == ("fp-old", "Be terse.", 3, 0)
        assert [m.content for m in st.messages("old-1")] == ["hello from v1"]
        assert st.messages("old-1")[0].token_span == (0, 3)
        assert st.cached_token_ids("old-1") == [5, 6, 7]
        # the upgraded database is fully usable: leases (v2) and appends
        with st.acquire_lease("old-1", auto_renew=False):
            st.append_message("old-1", "assistant", "hi")
        assert len(st.messages("old-1")) == 2
    with Store(home) as st:  # reopening an up-to-date DB is a no-op
        assert st.get_session("old-1").n_messages == 2


def test_v4_migration_keeps_existing_chunks_verified_and_adds_debris_tables(home: Path, index_engine: Engine) -> None:
    home.mkdir()
    _make_v1(index_engine)
    with index_engine.begin() as con:
        con.execute(text("INSERT INTO chatkv_chunks VALUES ('" + "a" * 64 + "', NULL, 'kv/aa/x.safetensors', 3, 10,"
                         " 'fp-old', 'k', 'none', 'float32', 16, '2025-01-01 00:00:00')"))
        con.execute(text("INSERT INTO chatkv_session_chunks VALUES ('old-1', 0, '" + "a" * 64 + "')"))
    with pytest.raises(StorageError, match="too old to read without migrating"):
        Store(home, read_only=True)
    with Store(home) as st:
        with st.engine.connect() as c:
            tables = set(inspect(c).get_table_names())
        assert {"chatkv_pending_files", "chatkv_meta"} <= tables
        assert st.get_session("old-1").kv_verified and st.kv_chunks("old-1")[0].verified
        assert st.index_lost() is None  # an upgraded index is not a new one
    # back to v3 (the release before): a read-only open cannot migrate it, but still lists and shows
    with index_engine.begin() as con:
        for st_ in ("DELETE FROM chatkv_schema WHERE version >= 4", "DROP TABLE chatkv_pending_files",
                    "DROP TABLE chatkv_meta", "ALTER TABLE chatkv_chunks DROP COLUMN verified"):
            con.execute(text(st_))
    with Store(home, read_only=True) as ro:
        assert ro.list_sessions()[0].id == "old-1" and ro.get_session("old-1").kv_verified
        assert [m.content for m in ro.messages("old-1")] == ["hello from v1"]


def test_newer_schema_is_refused_clearly(home: Path, index_engine: Engine) -> None:
    Store(home).close()
    with index_engine.begin() as con:
        con.execute(text("INSERT INTO chatkv_schema VALUES (:v, 'from the future', '2030-01-01 00:00:00')"),
                    {"v": SCHEMA_VERSION + 5})
    with pytest.raises(SchemaVersionError, match=rf"schema version {SCHEMA_VERSION + 5}, newer .*upgrade chatkv"):
        Store(home)
    with pytest.raises(SchemaVersionError, match=rf"schema version {SCHEMA_VERSION + 5}, newer .*upgrade chatkv"):
        Store(home, read_only=True)


def test_foreign_tables_without_version_are_refused(home: Path, index_engine: Engine) -> None:
    home.mkdir()
    with index_engine.begin() as con:
        con.execute(text("CREATE TABLE chatkv_sessions (id TEXT)"))
    with pytest.raises(SchemaVersionError, match="no chatkv_schema"):
        Store(home)


@pytest.mark.sqlite_only
def test_sqlite_pragmas_wal_and_foreign_keys(store: Store) -> None:
    with store.engine.connect() as c:
        assert c.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert c.execute(text("PRAGMA foreign_keys")).scalar() == 1


@pytest.mark.sqlite_only
def test_env_overrides_home_and_db_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path / "h1"))
    with Store() as st:
        assert st.home == tmp_path / "h1" and (tmp_path / "h1" / "index.db").exists()
    monkeypatch.setenv("CHATKV_DB_URL", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    with Store() as st:
        st.open_session("s")
    assert (tmp_path / "elsewhere.db").exists()
    with Store(db_url=f"sqlite:///{tmp_path / 'explicit.db'}") as st:
        assert st.db_url.endswith("explicit.db") and not st.has_session("s")


def test_default_home_is_platform_user_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    import platformdirs
    from chatkv.storage import default_home

    monkeypatch.delenv("CHATKV_HOME")
    assert default_home() == Path(platformdirs.user_data_dir("chatkv", appauthor=False))


def test_sessions_messages_and_listing(store: Store) -> None:
    info = store.open_session("s1", fingerprint=FP, system_prompt="sys")
    assert (info.id, info.n_messages, info.n_cached, info.tier) == ("s1", 0, 0, "none")
    store.open_session("s2")
    for role, text_ in [("system", "sys"), ("user", "q1"), ("assistant", "a1"), ("user", "q2")]:
        store.append_message("s1", role, text_, (0, 1))
    store.touch("s1", tier="device")
    assert [m.index for m in store.messages("s1")] == [0, 1, 2, 3]
    ls = {s.id: s for s in store.list_sessions()}
    assert ls["s1"].n_turns == 2 and ls["s1"].n_messages == 4 and ls["s1"].tier == "device"
    assert store.list_sessions()[0].id == "s1"  # most recently used first
    # reopening keeps everything and does not recreate
    again = store.open_session("s1", fingerprint="other", system_prompt="other")
    assert again.fingerprint == FP and again.system_prompt == "sys" and again.n_messages == 4
    assert store.truncate_history("s1", 2) == 2
    assert [m.content for m in store.messages("s1")] == ["sys", "q1"]
    with pytest.raises(SessionNotFoundError, match="nope"):
        store.open_session("nope", create=False)
    with pytest.raises(SessionNotFoundError):
        store.append_message("nope", "user", "x")


def test_delete_session_removes_rows_and_unshared_files(store: Store, home: Path) -> None:
    shared = list(range(64))
    for sid, tail in [("a", [1000, 1001]), ("b", [2000])]:
        store.open_session(sid)
        store.append_message(sid, "user", "hi")
        ids = shared + tail
        store.save_kv(sid, token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    before = store.disk_usage()
    assert before.n_files == 3  # shared chunk + two tails
    res = store.delete_session("a")
    assert res.files_removed == 1 and res.bytes_removed > 0
    assert not store.has_session("a") and store.disk_usage().n_files == 2
    with store.engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM chatkv_messages WHERE session_id='a'")).scalar() == 0
    assert store.load_kv("b").token_ids == shared + [2000]


def test_rewrite_history_replaces_the_tail_in_one_transaction(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    store.open_session("s")
    for role, content in [("system", "sys"), ("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")]:
        store.append_message("s", role, content)
    out = store.rewrite_history("s", 3, [("user", "q2 edited", (5, 9), False), ("assistant", "a2'", None, True)])
    assert [(m.index, m.content) for m in out] == [(3, "q2 edited"), (4, "a2'")]
    got = store.messages("s")
    assert [m.content for m in got] == ["sys", "q1", "a1", "q2 edited", "a2'"]
    assert got[3].token_span == (5, 9) and got[4].partial
    with pytest.raises(ValueError):
        store.rewrite_history("s", -1, [])

    from sqlalchemy.exc import OperationalError
    from sqlalchemy.orm import Session

    def full(self, *a, **k):
        raise OperationalError("INSERT", {}, Exception("database or disk is full"))

    monkeypatch.setattr(Session, "flush", full)
    with pytest.raises(StorageWriteError):
        store.rewrite_history("s", 1, [("user", "lost", None, False)])
    monkeypatch.undo()
    assert [m.content for m in store.messages("s")] == ["sys", "q1", "a1", "q2 edited", "a2'"]  # all or nothing
    assert [m.content for m in store.rewrite_history("s", 0, [])] == [] and store.messages("s") == []


def test_listing_is_one_query_with_correct_counts(store: Store) -> None:
    from sqlalchemy import event

    for n in range(5):
        sid = f"s{n}"
        store.open_session(sid, fingerprint=FP)
        for k in range(n):
            store.append_message(sid, "user" if k % 2 == 0 else "assistant", f"m{k}")
        ids = list(range(100 * n, 100 * n + 70 * n))
        if ids:
            store.save_kv(sid, token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    statements: list[str] = []
    listen = lambda conn, cursor, stmt, *a: statements.append(stmt)  # noqa: E731
    event.listen(store.engine, "before_cursor_execute", listen)
    try:
        infos = store.list_sessions()
    finally:
        event.remove(store.engine, "before_cursor_execute", listen)
    # (PostgreSQL's transactions begin with the index's advisory lock: not a query of the listing)
    assert len([s for s in statements if s.lstrip().upper().startswith("SELECT") and "pg_advisory" not in s]) == 1
    by_id = {i.id: i for i in infos}
    for n in range(5):
        i = by_id[f"s{n}"]
        assert (i.n_messages, i.n_turns, i.n_cached, i.n_chunks) == (n, (n + 1) // 2, 70 * n, -(-70 * n // 64))
        assert store.get_session(f"s{n}") == i


def test_byte_counts_past_2_gib_fit_and_v7_widens_an_older_postgresql_index(
        home: Path, index_engine: Engine, db_backend: str) -> None:
    big = 5 << 30  # a session's KV on a 7B model passes 2 GiB at about 4k tokens
    with Store(home) as st:
        st.open_session("s", fingerprint=FP)
        ids = list(range(70))
        st.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    if db_backend == "postgres":  # back to v6's 32-bit columns, as an index made before v7 has them
        with index_engine.begin() as con:
            con.execute(text("ALTER TABLE chatkv_sessions ALTER COLUMN kv_bytes TYPE INTEGER"))
            con.execute(text("ALTER TABLE chatkv_chunks ALTER COLUMN bytes TYPE INTEGER"))
            con.execute(text("DELETE FROM chatkv_schema WHERE version = 7"))
    with Store(home) as st:  # (re)applies v7
        with index_engine.begin() as con:
            con.execute(text("UPDATE chatkv_sessions SET kv_bytes = :b"), {"b": big})
            con.execute(text("UPDATE chatkv_chunks SET bytes = :b"), {"b": big})
        assert st.get_session("s").kv_bytes == big and st.kv_chunks("s")[0].bytes == big
        assert st.disk_usage().indexed_bytes == big * len(st.kv_chunks("s"))


def test_warm_up_compiles_what_reopening_a_session_runs_and_changes_nothing(home: Path) -> None:
    from sqlalchemy import event
    from sqlalchemy.engine.default import CACHE_MISS

    from chatkv.storage.store import WARM_UP_SESSION_ID

    ids = list(range(70))
    with Store(home, warm=False) as first:
        first.acquire_lease("s")
        first.open_session("s", fingerprint=FP)
        first.append_message("s", "user", "hi")
        first.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
        first.open_session(WARM_UP_SESSION_ID, fingerprint=FP)  # a session may have the id
        before = first.get_session(WARM_UP_SESSION_ID)
    store = Store(home, warm=False)
    try:
        store.warm_up()
        misses: list[str] = []

        def listen(conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
            if context is not None and context.cache_hit is CACHE_MISS:
                misses.append(statement)

        event.listen(store.engine, "before_cursor_execute", listen)
        try:  # what Chat() and its restore run on a stored session: the lease, the open, the history, the KV
            store.acquire_lease("s")
            store.open_session("s", fingerprint=FP)
            assert [m.content for m in store.messages("s")] == ["hi"]
            assert store.get_session("s").n_cached == 70
            assert store.open_kv("s", fingerprint=FP).token_ids == ids
        finally:
            event.remove(store.engine, "before_cursor_execute", listen)
        assert misses == []  # every statement was compiled by the warm-up
        assert store.get_session(WARM_UP_SESSION_ID) == before  # its rolled-back updates left nothing
        assert store.lease_holder(WARM_UP_SESSION_ID) is None
    finally:
        store.close()
