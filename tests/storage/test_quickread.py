"""``chatkv.storage.quickread`` answers exactly as a Store does on the same SQLite index.

The quick reader re-states the Store's read queries in plain SQL (so the
read-only CLI commands need no SQLAlchemy import); these tests keep the two
in step: on one varied index, every method of the reader returns what the
Store's method of the same name returns, and gc's dry-run plan over either is
the same. They also pin when the reader steps aside for a Store.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
from datetime import timedelta
from pathlib import Path

import pytest
from chatkv.storage import DiskPolicy, Store, collect_garbage, enforce_disk_policy
from chatkv.storage.migrations import LATEST_VERSION
from chatkv.storage.quickread import SCHEMA_VERSIONS, open_quick_reader, sqlite_file
from chatkv.storage.schema import utcnow

from .conftest import FP, new_chunks

pytestmark = pytest.mark.sqlite_only


@pytest.fixture
def varied(home: Path) -> Store:
    """A store with a bit of everything the read side reports."""
    store = Store(home)
    base = list(range(300))
    for sid, ids in (("plain", base), ("sharer", base[:128] + list(range(1000, 1100))), ("other", list(range(2000, 2070)))):
        store.open_session(sid, fingerprint=FP, system_prompt=f"system of {sid}")
        store.append_messages(sid, [("user", f"hello {sid}", (0, 3), False),
                                    ("assistant", "a reply cut short", (3, 9), True),
                                    ("user", "outside the window", None, False, True)])
        store.save_kv(sid, token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    store.open_session("text-only")
    store.append_message("text-only", "user", "no KV")
    store.create_session("imported", fingerprint=FP, token_ids=list(range(3000, 3064)),
                         chunks=new_chunks(list(range(3000, 3064))), kv_verified=False)
    store.set_retention("other", pinned=True)
    store.set_retention("sharer", kv_ttl_s=60.0)
    # a dangling row (file lost), an orphan file and a temp file, all older than any grace
    store.path_of(store.kv_chunks("plain")[-1]).unlink()
    orphan = store.write_chunk(list(range(5000, 5010)), new_chunks(list(range(10)))[0].tensors, new_chunks([1])[0].meta)
    tmp = store.path_of(orphan).parent / ".tmp-dead.123.abcd"
    tmp.write_bytes(b"x" * 100)
    for p in (store.path_of(orphan), tmp):
        os.utime(p, (0, 0))
    holder = Store(home)
    holder.acquire_lease("other", auto_renew=False)
    yield store
    holder.close()
    store.close()


def _fields(report: object) -> dict:
    out = dataclasses.asdict(report)  # type: ignore[call-overload]
    out.pop("seconds", None)
    return out


def test_the_reader_reads_the_latest_schema() -> None:
    assert LATEST_VERSION in SCHEMA_VERSIONS  # a new schema version needs its queries here too


def test_every_read_equals_the_stores(varied: Store, home: Path) -> None:
    reader = open_quick_reader(home)
    assert reader is not None
    with reader:
        assert reader.kv_dir == varied.kv_dir
        assert reader.list_sessions() == varied.list_sessions()
        assert {i.id for i in reader.list_sessions()} == {"plain", "sharer", "other", "text-only", "imported"}
        for sid in ("plain", "sharer", "other", "text-only", "imported"):
            assert reader.get_session(sid) == varied.get_session(sid)
            assert reader.messages(sid) == varied.messages(sid)
            assert reader.session_bytes(sid) == varied.session_bytes(sid)
            assert reader.has_session(sid) and reader.lease_holder(sid) == varied.lease_holder(sid)
            assert reader.path_of(varied.kv_chunks(sid)[0].hash) == varied.path_of(varied.kv_chunks(sid)[0]) \
                if varied.kv_chunks(sid) else True
        assert reader.session_bytes("sharer").shared > 0 and not reader.get_session("imported").kv_verified
        assert reader.lease_holder("other") is not None and reader.get_session("other").pinned
        assert reader.chunk_usage() == varied.chunk_usage()
        assert reader.disk_usage() == varied.disk_usage()
        assert reader.index_lost() is None and varied.index_lost() is None
        assert _fields(collect_garbage(reader, dry_run=True, grace_s=0)) == \
            _fields(collect_garbage(varied, dry_run=True, grace_s=0))
        later = utcnow() + timedelta(hours=1)
        for policy in (DiskPolicy(), DiskPolicy(kv_ttl_s=600), DiskPolicy(disk_budget_bytes=0),
                       DiskPolicy(kv_ttl_s=10**6, disk_budget_bytes=1)):
            assert _fields(enforce_disk_policy(reader, policy, dry_run=True, grace_s=0, now=later)) == \
                _fields(enforce_disk_policy(varied, policy, dry_run=True, grace_s=0, now=later))


def test_unknown_and_invalid_ids_fail_as_the_store_does(varied: Store, home: Path) -> None:
    with open_quick_reader(home) as reader:  # type: ignore[union-attr]
        for call in (reader.get_session, reader.messages, reader.session_bytes):
            with pytest.raises(type(_error(varied, call.__name__, "nope"))):
                call("nope")
            with pytest.raises(type(_error(varied, call.__name__, "../../etc"))):
                call("../../etc")


def _error(store: Store, method: str, sid: str) -> Exception:
    try:
        getattr(store, method)(sid)
    except Exception as e:
        return e
    raise AssertionError(f"Store.{method}({sid!r}) did not fail")


def test_a_lost_index_reads_the_same(varied: Store, home: Path, tmp_path: Path) -> None:
    varied.close()
    (home / "index.db").unlink()
    for suffix in ("-wal", "-shm"):
        Path(f"{home / 'index.db'}{suffix}").unlink(missing_ok=True)
    with Store(home) as fresh:  # recreated over the old chunk files: recorded as lost
        lost = fresh.index_lost()
    assert lost is not None
    with open_quick_reader(home) as reader:  # type: ignore[union-attr]
        assert reader.index_lost() == lost
        assert reader.list_sessions() == []


def test_it_steps_aside_where_a_store_is_needed(home: Path, tmp_path: Path) -> None:
    assert open_quick_reader(home) is None and not home.exists()  # no index yet; nothing created
    assert open_quick_reader(home, "postgresql+psycopg://u@h/db") is None
    Store(home).close()
    assert open_quick_reader(home) is not None
    conn = sqlite3.connect(home / "index.db")
    with conn:
        conn.execute("INSERT INTO chatkv_schema (version, description, applied_at) VALUES (99, 'future', '2030-01-01')")
    conn.close()
    assert open_quick_reader(home) is None  # a newer schema: the Store says so clearly


@pytest.mark.parametrize("url", [
    "sqlite:////abs/index.db", "sqlite:///rel/index.db", "sqlite://", "sqlite:///:memory:",
    "sqlite+pysqlite:////abs/x.db", "sqlite:////abs/x.db?timeout=3", "sqlite:///file:x.db?mode=ro&uri=true",
    "sqlite:////abs/with%20space.db", "postgresql://u@h/db",
])
def test_sqlite_file_never_disagrees_with_sqlalchemy(url: str) -> None:
    from chatkv.storage.db import sqlite_path

    got = sqlite_file(url)
    assert got is None or got == sqlite_path(url)
