"""Retention per conversation (issue 16): pins and per-session KV TTLs, stored
with the session, honoured by the tier policy, by gc and by the CLI."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner

from chatkv import Chat, EngineConfig
from chatkv.cli.main import main
from chatkv.engine import Engine
from chatkv.errors import ConfigError
from chatkv.models import load_model
from chatkv.persistence import default_store
from chatkv.storage import DiskPolicy, Store, enforce_disk_policy
from chatkv.tiers import TierConfig


def engine_with() -> Engine:
    return Engine(load_model("tiny:llama"), EngineConfig(num_blocks=256, block_size=4))


def chat(engine: Engine, sid: str, **kw) -> Chat:
    kw.setdefault("max_new_tokens", 6)
    return Chat(sid, engine=engine, system="sys", chunk_tokens=16, **kw)


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def settle(engine: Engine, *chats: Chat) -> float:
    """Wait for the turns' unpins; the latest last-use time of ``chats``."""
    engine.call(lambda: None)
    return max(c._session.kv.last_used for c in chats)


def test_a_pin_set_from_the_terminal_survives_the_idle_period_that_demotes_the_others():
    engine = engine_with()
    engine.configure_tiers(TierConfig(offload_after_s=10, spill_after_s=20, kv_ttl_s=40))
    for sid in ("keep", "other"):
        c = chat(engine, sid)
        c.send("hello")
        c.close()
    result = cli("sessions", "pin", "keep")
    assert result.exit_code == 0 and "keep: pinned" in result.output
    keep, other = chat(engine, "keep"), chat(engine, "other")
    keep.send("again")
    other.send("again")
    now = settle(engine, keep, other)
    engine.sessions.maintain(now=now + 100)  # idle well past every threshold, the TTL too
    assert keep.tier == "device" and other.tier == "expired"
    keep.send("still here")
    assert keep.last_stats.kv_source == "device" and keep.last_stats.reused_tokens > 0
    keep.close()
    other.close()
    # Chat(pin=False) unpins, and saves it.
    assert default_store().get_session("keep").pinned
    c = chat(engine, "keep", pin=False)
    assert not default_store().get_session("keep").pinned and not c._session.kv.keep_resident
    c.close()


def test_a_per_session_ttl_expires_exactly_that_sessions_kv_in_the_tier_policy():
    engine = engine_with()
    short, plain = chat(engine, "short", ttl=5), chat(engine, "plain")
    short.send("hello")
    plain.send("hello")
    now = settle(engine, short, plain)
    engine.sessions.maintain(now=now + 10)
    assert short.tier == "expired" and plain.tier == "device"
    assert default_store().get_session("short").n_cached == 0  # its stored KV went too
    assert default_store().get_session("plain").n_cached > 0
    short.send("again")  # the history stays: the turn re-prefills
    assert short.last_stats.kv_source == "expired" and len(short.messages) == 5
    short.close()
    plain.close()
    info = default_store().get_session("short")
    assert info.kv_ttl_s == 5 and not info.pinned


def test_gc_honours_per_session_ttls_and_pins():
    engine = engine_with()
    for sid, kw in (("short", {"ttl": 60}), ("plain", {}), ("pinned", {"pin": True}), ("long", {"ttl": 7200})):
        c = chat(engine, sid, **kw)
        c.send("hello")
        c.close()
    store = default_store()
    soon = datetime.now(timezone.utc) + timedelta(seconds=120)
    report = enforce_disk_policy(store, DiskPolicy(), now=soon, grace_s=0)
    assert report.expired_sessions == ["short"]  # exactly that session's KV, with no store-wide TTL
    assert {s.id: s.n_cached > 0 for s in store.list_sessions()} == \
        {"short": False, "plain": True, "pinned": True, "long": True}
    later = soon + timedelta(hours=1)
    report = enforce_disk_policy(store, DiskPolicy(kv_ttl_s=600), now=later, grace_s=0)
    # The store-wide TTL expires "plain"; "long" has its own, longer TTL; a pin never expires.
    assert report.expired_sessions == ["plain"]
    report = enforce_disk_policy(store, DiskPolicy(kv_ttl_s=600), now=later + timedelta(hours=2), grace_s=0)
    assert report.expired_sessions == ["long"]
    assert store.get_session("pinned").n_cached > 0
    # Over the disk budget, a pinned session goes last.
    report = enforce_disk_policy(store, DiskPolicy(disk_budget_bytes=0), grace_s=0)
    assert report.over_budget_sessions == ["pinned"]


def test_cli_pin_unpin_and_ttl_are_shown_by_ls_and_show():
    with Store() as store:
        for sid in ("a", "b"):
            store.open_session(sid, fingerprint="f" * 64)
    assert cli("sessions", "pin", "a", "--ttl", "7d").exit_code == 0
    assert cli("sessions", "ttl", "b", "90m").exit_code == 0
    out = cli("sessions", "ls").output
    row = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["a"], ["b"])}
    assert row["a"][-2:] == ["yes", "7d"] and row["b"][-2:] == ["-", "90m"]
    assert "pinned, KV TTL 7d" in cli("sessions", "show", "a").output
    assert cli("sessions", "unpin", "a", "--ttl", "none").exit_code == 0
    with Store() as store:
        a, b = store.get_session("a"), store.get_session("b")
    assert (a.pinned, a.kv_ttl_s, b.pinned, b.kv_ttl_s) == (False, None, False, 5400.0)
    import json

    listed = {s["id"]: s for s in json.loads(cli("sessions", "ls", "--json").output)}
    assert listed["b"]["kv_ttl_s"] == 5400.0 and listed["a"]["pinned"] is False
    missing = cli("sessions", "pin", "nope")
    assert missing.exit_code == 3
    assert cli("sessions", "ttl", "a", "soon").exit_code == 2


def test_ttl_is_validated():
    engine = engine_with()
    with pytest.raises(ConfigError, match="ttl"):
        Chat("bad", engine=engine, ttl=-1)
    with pytest.raises(ValueError):
        with Store() as store:
            store.open_session("x")
            store.set_retention("x", kv_ttl_s=-5)


def test_the_retention_migration_adds_its_columns_to_an_older_index(tmp_path):
    """The v5 step on an index without the retention columns: sessions come back unpinned, with no TTL."""
    import sqlalchemy as sa

    from chatkv.storage.migrations import MIGRATIONS

    home = tmp_path / "old"
    with Store(home) as store:
        store.open_session("s", fingerprint="f" * 64)
    engine = sa.create_engine(f"sqlite:///{home / 'index.db'}")
    with engine.begin() as conn:  # the sessions table as it was before v5
        conn.exec_driver_sql("ALTER TABLE chatkv_sessions DROP COLUMN pinned")
        conn.exec_driver_sql("ALTER TABLE chatkv_sessions DROP COLUMN kv_ttl_s")
        step = next(m for m in MIGRATIONS if m.version == 5)
        assert "retention" in step.description
        step.apply(conn)
    engine.dispose()
    with Store(home) as store:
        info = store.get_session("s")
        assert (info.pinned, info.kv_ttl_s) == (False, None)
        store.set_retention("s", pinned=True, kv_ttl_s=30)
        info = store.get_session("s")
        assert (info.pinned, info.kv_ttl_s) == (True, 30.0)
