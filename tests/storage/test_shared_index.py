"""Several processes on one index and one chunk directory (issue 15): each on SQLite and PostgreSQL.

Real processes (``subprocess``), driven in lockstep through their stdin and
stdout, never by the clock: two opening a new index at once, two writing the
same content-addressed chunk at once, one reading while another collects
garbage. On PostgreSQL only: a Store survives a restart of the server, and a
transaction the restart cuts fails without committing anything.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from chatkv.storage import SCHEMA_VERSION, MissingChunkError, StorageError, Store, collect_garbage
from sqlalchemy import create_engine, text

from .conftest import FP, new_chunks

_ROOT = Path(__file__).resolve().parents[2]

#: Child-side helpers: the same deterministic chunks as conftest.new_chunks, so two
#: processes saving the same token ids write byte-identical files.
_CHILD_PRELUDE = textwrap.dedent("""
    import json, os, sys
    import torch
    from chatkv.storage import ChunkMeta, NewChunk, Store, collect_garbage
    META = ChunkMeta(fingerprint="fp-test-model", kv_format="paged-v1", dtype="float32", block_size=16, quant="none")

    def kv_for(ids):
        g = torch.Generator().manual_seed(hash(tuple(ids)) & 0x7FFFFFFF)
        return {"kv": torch.randn(2, 2, -(-len(ids) // 16), 16, 2, 8, generator=g)}

    def new_chunks(ids):
        return [NewChunk(len(ids[a:a + 64]), kv_for(ids[a:a + 64]), META) for a in range(0, len(ids), 64)]

    def say(*words):
        print(*words, flush=True)
""")


def _child(body: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONHASHSEED="0")  # hash(tuple) seeds kv_for: the same in every child
    return subprocess.Popen([sys.executable, "-c", _CHILD_PRELUDE + textwrap.dedent(body), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=_ROOT)


def _send(p: subprocess.Popen[str], line: str) -> None:
    assert p.stdin is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()


def _expect(p: subprocess.Popen[str], word: str) -> str:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line.startswith(word):
        rest = p.communicate(timeout=60)
        raise AssertionError(f"child said {line!r}, not {word!r}:\n{rest[0]}{rest[1][-3000:]}")
    return line[len(word):].strip()


def _finish(*procs: subprocess.Popen[str]) -> None:
    """Close each child's stdin (its loop ends), wait for it, and check that it exited 0."""
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, out + err[-3000:]


@pytest.fixture
def shared_url(db_backend: str, tmp_path: Path) -> str:
    """The index every process of a test opens (an SQLite file outside their homes, or the test's database)."""
    return os.environ.get("CHATKV_DB_URL") or f"sqlite:///{tmp_path / 'shared-index.db'}"


def _hold_write_lock(url: str):
    """A transaction holding the index's write lock (PostgreSQL's advisory lock, SQLite's
    reserved lock) until its ``rollback()``: what every chatkv writer waits for."""
    engine = create_engine(url)
    conn = engine.connect()
    if engine.dialect.name == "postgresql":
        from chatkv.storage.db import PG_LOCK_KEY

        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({PG_LOCK_KEY})")
    else:
        conn.connection.dbapi_connection.isolation_level = None
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    return engine, conn


def _waiting_for_lock(url: str) -> int:
    """How many sessions wait for chatkv's advisory lock (PostgreSQL)."""
    from chatkv.storage.db import PG_LOCK_KEY

    engine = create_engine(url)
    try:
        with engine.connect() as c:
            return int(c.execute(text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND ((classid::bigint << 32) | objid::bigint) = :key"), {"key": PG_LOCK_KEY}).scalar())
    finally:
        engine.dispose()


def test_two_processes_opening_a_new_index_at_once_apply_it_once(shared_url: str, tmp_path: Path,
                                                                 db_backend: str) -> None:
    if db_backend == "sqlite":
        Path(shared_url.removeprefix("sqlite:///")).touch()  # an empty database file to lock
    engine, holder = _hold_write_lock(shared_url)
    body = """
        say("ready")
        sys.stdin.readline()
        st = Store(sys.argv[1], db_url=sys.argv[2])
        say("opened", json.dumps(st.index_created))
        st.close()
    """
    procs = [_child(body, str(tmp_path / f"home-{i}"), shared_url) for i in range(2)]
    try:
        for p in procs:
            _expect(p, "ready")
            _send(p, "go")
        if db_backend == "postgres":  # both are blocked on the lock before it is released
            import time

            while _waiting_for_lock(shared_url) < 2:
                assert all(p.poll() is None for p in procs), "a child exited early"
                time.sleep(0.05)
    finally:
        holder.rollback()
        holder.close()
        engine.dispose()
    created = [json.loads(_expect(p, "opened")) for p in procs]
    _finish(*procs)
    assert sorted(created) == [False, True]  # one created the tables, the other waited and found them
    check = create_engine(shared_url)
    with check.connect() as c:
        versions = [r[0] for r in c.execute(text("SELECT version FROM chatkv_schema ORDER BY version"))]
    check.dispose()
    assert versions == list(range(1, SCHEMA_VERSION + 1))


def test_kv_dir_setting_lets_homes_share_chunks(tmp_path: Path, shared_url: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared-kv"
    monkeypatch.setenv("CHATKV_KV_DIR", str(shared))
    ids = list(range(150))
    with Store(tmp_path / "a", db_url=shared_url) as a:
        assert a.kv_dir == shared
        a.open_session("s", fingerprint=FP)
        a.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    assert len(list(shared.glob("*/*.safetensors"))) == 3 and not (tmp_path / "a" / "kv").exists()
    monkeypatch.delenv("CHATKV_KV_DIR")
    with Store(tmp_path / "b", db_url=shared_url, kv_dir=shared) as b:  # another home, the same chunks
        assert b.load_kv("s").token_ids == ids
        assert collect_garbage(b, dry_run=True, grace_s=0).orphan_files == []
    with Store(tmp_path / "c", db_url=shared_url) as c:  # a server not given the shared directory
        assert c.kv_dir == tmp_path / "c" / "kv"
        with pytest.raises(MissingChunkError, match="does not exist"):
            c.load_kv("s")
    with Store(tmp_path / "b", db_url=shared_url, kv_dir=shared) as b:  # ... cut nobody's KV for that
        assert b.load_kv("s").token_ids == ids


def test_two_processes_writing_the_same_chunks_at_once(tmp_path: Path, shared_url: str) -> None:
    kv = tmp_path / "shared-kv"
    body = """
        st = Store(sys.argv[1], db_url=sys.argv[2], kv_dir=sys.argv[3])
        tag = sys.argv[4]
        for line in sys.stdin:
            i = int(line)
            ids = list(range(1000 * i, 1000 * i + 150))
            st.open_session(f"{tag}-{i}", fingerprint=META.fingerprint)
            st.save_kv(f"{tag}-{i}", token_ids=ids, fingerprint=META.fingerprint, chunks=new_chunks(ids))
            say("saved")
        st.close()
    """
    procs = [_child(body, str(tmp_path / f"home-{t}"), shared_url, str(kv), t) for t in "ab"]
    rounds = 12
    for i in range(rounds):  # both get the same turn at once, then both finish it
        for p in procs:
            _send(p, str(i))
        for p in procs:
            _expect(p, "saved")
    _finish(*procs)
    with Store(tmp_path / "check", db_url=shared_url, kv_dir=kv) as st:
        for i in range(rounds):
            a, b = st.load_kv(f"a-{i}"), st.load_kv(f"b-{i}")  # every chunk verifies (checksums)
            assert a.token_ids == b.token_ids == list(range(1000 * i, 1000 * i + 150))
            assert [c.info.hash for c in a.chunks] == [c.info.hash for c in b.chunks]
        assert len(list(kv.glob("*/*.safetensors"))) == 3 * rounds  # stored once each
        assert list(kv.glob("*/.tmp-*")) == []
        report = collect_garbage(st, dry_run=True, grace_s=0)
        assert report.orphan_files == [] and report.unreferenced_chunks == [] and report.dangling_chunks == []


def test_reading_while_another_process_collects_garbage(tmp_path: Path, shared_url: str) -> None:
    kv = tmp_path / "shared-kv"
    keep = list(range(200))
    with Store(tmp_path / "setup", db_url=shared_url, kv_dir=kv) as st:
        st.open_session("keep", fingerprint=FP)
        st.save_kv("keep", token_ids=keep, fingerprint=FP, chunks=new_chunks(keep))
    reader = _child("""
        st = Store(sys.argv[1], db_url=sys.argv[2], kv_dir=sys.argv[3])
        want = list(range(200))
        for line in sys.stdin:
            for _ in range(3):
                assert st.load_kv("keep").token_ids == want
            say("read")
        st.close()
    """, str(tmp_path / "reader"), shared_url, str(kv))
    collector = _child("""
        st = Store(sys.argv[1], db_url=sys.argv[2], kv_dir=sys.argv[3])
        for line in sys.stdin:
            j = int(line)
            ids = list(range(128)) + list(range(5000 + 100 * j, 5000 + 100 * j + 90))  # shares keep's first 2 chunks
            st.open_session(f"tmp-{j}", fingerprint=META.fingerprint)
            st.save_kv(f"tmp-{j}", token_ids=ids, fingerprint=META.fingerprint, chunks=new_chunks(ids))
            st.delete_session(f"tmp-{j}")
            report = collect_garbage(st, dry_run=False, grace_s=0)
            say("collected", report.files_removed)
        st.close()
    """, str(tmp_path / "collector"), shared_url, str(kv))
    for j in range(10):  # each round: the reader reads three times while the collector saves, deletes, collects
        _send(reader, "go")
        _send(collector, str(j))
        _expect(reader, "read")
        _expect(collector, "collected")
    _finish(reader, collector)
    with Store(tmp_path / "check", db_url=shared_url, kv_dir=kv) as st:
        assert st.load_kv("keep").token_ids == keep
        assert len(list(kv.glob("*/*.safetensors"))) == 4  # keep's chunks; every tmp tail went


# ---------------------------------------------------------------------------- PostgreSQL restarts


def test_a_store_carries_on_after_the_server_restarts(db_backend: str, home: Path,
                                                      request: pytest.FixtureRequest) -> None:
    if db_backend != "postgres":
        pytest.skip("restarts a PostgreSQL server")
    cluster = request.getfixturevalue("pg_cluster")
    with Store(home) as st:
        st.open_session("s", fingerprint=FP)
        st.append_message("s", "user", "before")
        cluster.restart()  # every pooled connection is now dead
        st.append_message("s", "assistant", "after")  # the pool notices (pre-ping) and reconnects
        ids = list(range(100))
        st.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
        cluster.restart()
        assert [m.content for m in st.messages("s")] == ["before", "after"]
        assert st.load_kv("s").token_ids == ids


def test_releasing_a_lease_while_the_server_is_down_is_logged_and_the_lease_lapses(
        db_backend: str, tmp_path: Path, shared_url: str, request: pytest.FixtureRequest,
        caplog: pytest.LogCaptureFixture) -> None:
    if db_backend != "postgres":
        pytest.skip("stops a PostgreSQL server")
    cluster = request.getfixturevalue("pg_cluster")
    with Store(tmp_path / "a", db_url=shared_url, lease_ttl_s=1.0) as a, \
            Store(tmp_path / "b", db_url=shared_url) as b:
        a.open_session("s", fingerprint=FP)
        a.acquire_lease("s")
        cluster.stop(remove=False)
        try:
            with caplog.at_level(logging.WARNING, logger="chatkv.storage.store"):
                a.release_lease("s")  # a chat closing after its turn was saved: no error for the client
        finally:
            cluster.start()
        assert "could not release the lease on session 's'" in caplog.text
        assert b.lease_holder("s") in (a.owner, None)  # still a's row, or already lapsed
        lease = b.acquire_lease("s", timeout_s=30)  # no longer renewed: it lapses and b takes it over
        assert lease.generation == 2
        b.release_lease("s")


def test_a_write_cut_by_a_restart_fails_and_commits_nothing(db_backend: str, home: Path,
                                                            request: pytest.FixtureRequest) -> None:
    if db_backend != "postgres":
        pytest.skip("restarts a PostgreSQL server")
    import time

    cluster = request.getfixturevalue("pg_cluster")
    url = os.environ["CHATKV_DB_URL"]
    with Store(home) as st:
        st.open_session("s", fingerprint=FP)
        st.append_message("s", "user", "kept")
        engine, holder = _hold_write_lock(url)
        got: list[BaseException | None] = []

        def write() -> None:
            try:
                st.append_messages("s", [("assistant", "cut", None, False), ("user", "cut too", None, False)])
                got.append(None)
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                got.append(e)

        t = threading.Thread(target=write)
        t.start()
        while _waiting_for_lock(url) < 1:  # the write is inside its transaction, waiting for the lock
            assert t.is_alive()
            time.sleep(0.05)
        cluster.restart()
        t.join()
        holder.invalidate()
        engine.dispose()
        assert isinstance(got[0], StorageError) and "index write failed" in str(got[0])
        assert [m.content for m in st.messages("s")] == ["kept"]  # nothing of the cut transaction
        st.append_message("s", "assistant", "retried")
        assert [m.content for m in st.messages("s")] == ["kept", "retried"]


def test_the_cli_finds_chunks_in_the_kv_dir(tmp_path: Path, shared_url: str) -> None:
    kv = tmp_path / "shared-kv"
    ids = list(range(150))
    with Store(tmp_path / "server", db_url=shared_url, kv_dir=kv) as st:
        st.open_session("s", fingerprint=FP)
        st.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    env = {**os.environ, "CHATKV_HOME": str(tmp_path / "cli-home"), "CHATKV_DB_URL": shared_url,
           "CHATKV_KV_DIR": str(kv)}
    cli = [sys.executable, "-m", "chatkv.cli.main", "sessions"]
    ls = subprocess.run([*cli, "ls", "--json"], env=env, capture_output=True, text=True, timeout=120, cwd=_ROOT)
    assert ls.returncode == 0, ls.stderr
    assert [(r["id"], r["n_cached"]) for r in json.loads(ls.stdout)] == [("s", 150)]
    gc = subprocess.run([*cli, "gc", "--dry-run", "--grace", "0", "--json"], env=env, capture_output=True, text=True,
                        timeout=120, cwd=_ROOT)
    assert gc.returncode == 0, gc.stderr
    report = json.loads(gc.stdout)
    found = json.dumps(report)
    assert "dangling" in found and all(not v for k, v in _walk(report) if k in ("dangling_chunks", "orphan_files"))
    assert len(list(kv.glob("*/*.safetensors"))) == 3


def _walk(d):
    """(key, value) of every key in a nested JSON object."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield k, v
            yield from _walk(v)
    elif isinstance(d, list):
        for v in d:
            yield from _walk(v)


def test_one_store_serves_as_many_threads_as_chatkv_serve_runs(home: Path) -> None:
    from chatkv.storage.db import MAX_OVERFLOW, POOL_SIZE

    n = 40  # chatkv serve's 32 worker threads, plus lease renewals and restores
    assert POOL_SIZE + MAX_OVERFLOW >= n
    errors: list[BaseException] = []
    start = threading.Barrier(n)
    with Store(home) as st:
        def work(i: int) -> None:
            try:
                start.wait()
                st.open_session(f"t{i}")
                for k in range(3):
                    st.append_message(f"t{i}", "user", f"m{k}")
                assert len(st.messages(f"t{i}")) == 3
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(st.list_sessions()) == n
