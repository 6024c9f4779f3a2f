"""Memory tiers: demotion by policy and pressure, promotion, budgets, gc."""

from __future__ import annotations

import random
import threading
import time

import pytest

from chatkv import Chat, EngineConfig
from chatkv.engine import Engine
from chatkv.models import load_model
from chatkv.persistence import LOSSY_FORMAT, default_store
from chatkv.storage import DiskPolicy, Store, enforce_disk_policy
from chatkv.tiers import Tier, TierConfig

BS = 4


def engine_with(num_blocks: int = 256) -> Engine:
    return Engine(load_model("tiny:llama"), EngineConfig(num_blocks=num_blocks, block_size=BS))


def chat(engine, sid, persist=True, **kw):
    kw.setdefault("max_new_tokens", 6)
    return Chat(sid, engine=engine, persist=persist, chunk_tokens=16, **kw)


NO_GATE = {"int8": 0.0, "fp8": 0.0, "int4": 0.0}


@pytest.mark.parametrize("target", ["host", "disk"])
def test_full_precision_tiers_resume_exactly(target):
    engine = engine_with()
    ref = chat(engine_with(), "ref", persist=False, system="sys")
    c = chat(engine, "s", system="sys")
    for text in ["one", "two"]:
        ref.send(text)
        c.send(text)
    cached = c.num_cached_tokens
    assert engine.sessions.demote("s", target)
    assert c.tier == target and engine.pool_stats().used_blocks == 0
    ref.send("three")
    c.send("three")
    assert c.last_stats.kv_source == target
    assert c.last_stats.reused_tokens == ref.last_stats.reused_tokens and c.last_stats.reused_tokens >= cached - 8
    assert c.last_stats.token_ids == ref.last_stats.token_ids
    assert c._session.kv.seq.exact
    assert engine.tier_stats().hits[target] == 1


def test_quantized_tier_is_marked_lossy_and_never_shared():
    engine = engine_with()
    engine.configure_tiers(TierConfig(quant_scheme="int8", fidelity_floors=NO_GATE))
    system = "You are a terse assistant. " * 2
    a = chat(engine, "a", system=system)
    a.send("hello")
    assert engine.sessions.demote("a", Tier.QUANTIZED)
    st = engine.tier_stats()
    assert st.sessions["quantized"] == 1 and 0 < st.bytes["quantized"]
    assert st.bytes_per_token["int8"] < st.bytes_per_token["none"] / 3
    a.send("again")
    assert a.last_stats.kv_source == "quantized" and not a._session.kv.seq.exact
    assert a.last_stats.reused_tokens > 0
    # a's approximate blocks are never offered by hash; a new session with the
    # same system prompt may only share the exact blocks cached before demotion.
    pool = engine.pool
    assert engine.call(lambda: all(pool.block_hash[blk] is None for blk in a._session.kv.seq.block_table))
    b = chat(engine, "b", system=system)
    b.send("hi")
    assert not set(b._session.kv.seq.block_table) & set(a._session.kv.seq.block_table)
    assert all(info.kv_format == LOSSY_FORMAT for info in default_store().kv_chunks("a")[-1:])


def test_idle_policies_walk_a_session_down_the_tiers():
    engine = engine_with()
    config = TierConfig(quant_scheme="int8", quantize_after_s=10, offload_after_s=20, spill_after_s=30,
                        kv_ttl_s=40, fidelity_floors=NO_GATE)
    engine.configure_tiers(config)
    c = chat(engine, "idle", system="sys")
    c.send("hello")
    engine.call(lambda: None)  # the turn's unpin has run
    t0 = c._session.kv.last_used
    for dt, tier in [(5, "device"), (11, "quantized"), (21, "host"), (31, "disk"), (41, "expired")]:
        engine.sessions.maintain(now=t0 + dt)
        assert c.tier == tier, dt
    assert engine.pool_stats().used_blocks == 0
    assert default_store().get_session("idle").n_cached == 0  # KV expired on disk too
    c.send("back")  # history intact: re-prefilled
    # Nothing of its own was kept; only exact blocks still cached in the pool's
    # prefix cache (the session's own, released on demotion) may be reused.
    assert c.last_stats.kv_source == "expired"
    assert c.last_stats.reused_tokens == c.last_stats.prefix_cache_tokens
    assert c.last_stats.not_reused is not None and "expired" in c.last_stats.not_reused
    assert len(c.messages) == 5


def test_pressure_demotes_the_least_recently_used_idle_session():
    engine = engine_with(num_blocks=24)
    engine.configure_tiers(TierConfig(host_budget_bytes=1 << 30))
    sessions = [chat(engine, f"u{i}", max_new_tokens=4) for i in range(3)]
    for c in sessions:
        c.send("a message that takes some blocks")
    sessions[0].send("touch the first one again")
    big = chat(engine, "big", max_new_tokens=4)
    big.send("x " * 20)
    tiers = {c.session_id: c.tier for c in sessions}
    assert tiers["u1"] == "host"  # least recently used
    assert tiers["u0"] == "device" or tiers["u2"] != "device"
    # What was demoted made the room: the big turn ran on the device without preemption.
    assert big.last_stats.kv_source == "device" and big.last_stats.preemptions == 0
    assert engine.tier_stats().demotions["host"] >= 1
    assert big.num_cached_tokens > 0


def test_fidelity_gate_falls_back_to_full_precision():
    engine = engine_with()
    engine.configure_tiers(TierConfig(quant_scheme="int4", fidelity_floors={"int4": 1.01, "fp8": 1.01,
                                                                          "int8": 1.01}))
    assert engine.call(engine.tiers.effective_scheme) == "none"
    engine.configure_tiers(TierConfig(quant_scheme="int4", fidelity_floors={"int4": 1.01, "fp8": 0.5,
                                                                          "int8": 0.5}))
    assert engine.call(engine.tiers.effective_scheme) == "fp8"
    from chatkv.fidelity import cached_results

    measured = cached_results(engine.loaded.fingerprint)
    assert set(measured) >= {"int4", "fp8"} and 0 <= measured["fp8"].top1_agreement <= 1


def test_200_sessions_under_small_budgets_stay_correct_and_within_budget():
    """A simulated workload: 200 sessions, 2 turns each in random order, with a
    device pool and host budget far smaller than their total KV."""
    rng = random.Random(0)
    engine = engine_with(num_blocks=48)  # 192 tokens on the device
    per_block = engine.pool.bytes_per_block
    config = TierConfig(device_budget_bytes=40 * per_block, host_budget_bytes=60 * per_block)
    engine.configure_tiers(config)
    reference_engine = engine_with(num_blocks=4096)
    order = [(i, t) for i in range(200) for t in range(2)]
    rng.shuffle(order)
    order.sort(key=lambda x: x[1])  # first turns before second turns, sessions interleaved
    chats, refs = {}, {}
    max_device = max_host = 0
    total_kv = 0
    for i, turn in order:
        sid = f"user-{i}"
        if sid not in chats:
            chats[sid] = chat(engine, sid, system=f"Session {i % 7}.", max_new_tokens=3)
            refs[sid] = chat(reference_engine, sid, persist=False, system=f"Session {i % 7}.", max_new_tokens=3)
        text = f"message {turn} from {i}"
        got = chats[sid].send(text)
        want = refs[sid].send(text)
        assert got == want, (sid, turn)
        assert chats[sid].last_stats.token_ids == refs[sid].last_stats.token_ids
        device, host = engine.call(lambda: (engine.tiers.device_bytes(), engine.tiers.host_bytes()))
        max_device = max(max_device, device)
        max_host = max(max_host, host)
        total_kv += chats[sid].num_cached_tokens
    assert max_device <= config.device_budget_bytes
    assert max_host <= config.host_budget_bytes
    assert total_kv * per_block / BS > 10 * (config.device_budget_bytes + config.host_budget_bytes)
    stats = engine.tier_stats()
    assert stats.hits["host"] + stats.hits["disk"] > 50  # most second turns came back from a lower tier
    for sid, c in chats.items():
        assert len(c.messages) == 5
        c.close()
    assert engine.pool_stats().used_blocks == 0


def test_gc_reclaims_orphans_expired_sessions_and_unreferenced_chunks(chatkv_home):
    engine = engine_with()
    for i in range(3):
        c = chat(engine, f"g{i}", system="sys")
        c.send(f"hello {i}")
        c.close()
    store = default_store()
    orphan = chatkv_home / "kv" / "ab" / ("ab" + "0" * 62 + ".safetensors")
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"x" * 5000)
    import os

    old = time.time() - 3600
    os.utime(orphan, (old, old))
    before = store.disk_usage().file_bytes
    dry = enforce_disk_policy(store, DiskPolicy(kv_ttl_s=0), dry_run=True)
    assert dry.orphan_files == 1 and len(dry.expired_sessions) == 3
    assert store.disk_usage().file_bytes == before  # dry run changes nothing
    report = enforce_disk_policy(store, DiskPolicy(kv_ttl_s=0))
    assert report.bytes_reclaimed >= 5000 and not orphan.exists()
    assert store.disk_usage().file_bytes == report.disk_bytes_after < before
    assert store.disk_usage().n_files == 0
    assert [len(store.messages(f"g{i}")) for i in range(3)] == [3, 3, 3]  # histories stay


def test_gc_concurrent_with_an_active_chat_keeps_its_chunks():
    engine = engine_with()
    c = chat(engine, "live", system="sys", max_new_tokens=5)
    store = Store()  # `chatkv sessions gc` runs as another owner (another process)
    errors = []
    stop = threading.Event()

    def gc_loop():
        while not stop.is_set():
            try:
                report = enforce_disk_policy(store, DiskPolicy(kv_ttl_s=0))
                assert "live" not in report.expired_sessions
            except Exception as exc:  # pragma: no cover - the assertion below reports it
                errors.append(exc)

    t = threading.Thread(target=gc_loop)
    t.start()
    try:
        for i in range(6):
            c.send(f"turn {i}")
    finally:
        stop.set()
        t.join()
        store.close()
    assert not errors
    assert all(w.persist_error is None for w in [c.last_stats])
    cached = c.num_cached_tokens
    c.close()
    again = chat(engine_with(), "live")
    assert again.wait_restored().cached_tokens == cached


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_uses_pinned_memory_and_round_trips():
    import torch

    from chatkv.offload import offload, reload
    from chatkv.sequence import Sequence

    loaded = load_model("tiny:llama", device="cuda")
    engine = Engine(loaded, EngineConfig(num_blocks=64, block_size=BS, device="cuda"))
    seq = Sequence(token_ids=list(range(1, 31)))
    engine.prefill(seq)

    def round_trip(scheme):
        off = offload(engine.pool, seq, scheme).to(torch.device("cpu"))
        pinned = all(t.is_pinned() for t in off.tensors())
        back = Sequence()
        reload(engine.pool, back, off)
        a = engine.pool.read_tokens(seq, 0, 30)
        b = engine.pool.read_tokens(back, 0, 30)
        exact = back.exact  # before the release, which resets it
        engine.pool.release(back)
        return pinned, a, b, exact

    for scheme in ("none", "int8"):
        pinned, a, b, exact = engine.call(lambda: round_trip(scheme))
        assert pinned
        if scheme == "none":
            assert torch.equal(a, b) and exact
        else:
            assert (a - b).abs().max() < 0.05 * a.abs().max() and not exact


def test_maintenance_runs_store_gc_and_skips_open_sessions():
    engine = engine_with()
    closed = chat(engine, "closed-one", system="sys")
    closed.send("hello")
    closed.close()
    open_chat = chat(engine, "still-open", system="sys")
    open_chat.send("hello")
    engine.configure_tiers(TierConfig(kv_ttl_s=3600, store_gc_interval_s=0))
    store = default_store()
    engine.sessions.maintain()
    assert store.get_session("closed-one").n_cached > 0  # not idle long enough
    engine.configure_tiers(TierConfig(kv_ttl_s=0, store_gc_interval_s=0))
    engine.call(lambda: None)  # the last turn's unpin has run
    engine.sessions.maintain(now=open_chat._session.kv.last_used + 1)
    assert store.get_session("closed-one").n_cached == 0  # expired by the store gc
    assert len(store.messages("closed-one")) == 3  # history stays
    assert open_chat.tier == "expired"  # the open one by the in-process policy instead
    assert store.get_session("still-open").n_cached == 0  # its stored KV expired with it
    open_chat.send("back")
    assert len(open_chat.messages) == 5


def test_quantized_tiers_under_pressure_stay_close_to_full_precision():
    """A workload whose sessions keep coming back from the int8 tier: the greedy
    tokens agree with full precision at about the rate the gate measured."""
    engine = engine_with(num_blocks=64)
    per_block = engine.pool.bytes_per_block
    engine.configure_tiers(TierConfig(quant_scheme="int8", device_budget_bytes=56 * per_block,
                                      fidelity_floors=NO_GATE))
    reference_engine = engine_with(num_blocks=2048)
    same = total = 0
    chats, refs = {}, {}
    for turn in range(2):
        for i in range(12):
            sid = f"q{i}"
            if sid not in chats:
                chats[sid] = chat(engine, sid, persist=False, system=f"Session {i % 5}.", max_new_tokens=4)
                refs[sid] = chat(reference_engine, sid, persist=False, system=f"Session {i % 5}.",
                                 max_new_tokens=4)
            text = f"message {turn} from {i}"
            chats[sid].send(text)
            refs[sid].send(text)
            # Compare tokens on the same history: follow the reference's reply.
            chats[sid]._session.messages[-1].content = refs[sid].messages[-1]["content"]
            got, want = chats[sid].last_stats.token_ids, refs[sid].last_stats.token_ids
            same += sum(a == b for a, b in zip(got, want))
            total += len(want)
    hits = engine.tier_stats().hits
    # Turns came back from int8 copies (host copies are quantized the same way).
    assert hits["quantized"] + hits["host"] >= 5, hits
    assert engine.call(engine.tiers.device_bytes) <= 56 * per_block
    assert same / total >= 0.9, same / total


def test_a_pinned_session_survives_the_idle_period_that_demotes_the_others():
    engine = engine_with()
    engine.configure_tiers(TierConfig(offload_after_s=10, spill_after_s=20))
    keep = chat(engine, "keep", system="sys", pin=True)
    other = chat(engine, "other", system="sys")
    keep.send("hello")
    other.send("hello")
    engine.call(lambda: None)  # both turns' unpins have run
    now = max(keep._session.kv.last_used, other._session.kv.last_used)
    engine.sessions.maintain(now=now + 30)
    assert keep.tier == "device" and other.tier == "disk"
    keep.send("still here")
    assert keep.last_stats.kv_source == "device" and keep.last_stats.reused_tokens > 0


def test_rewind_releases_the_dropped_turns_kv_at_once():
    engine = engine_with()
    c = chat(engine, "rw", system="sys")
    for text in ["one", "two", "three"]:
        c.send(text)
    before_blocks = engine.pool_stats().used_blocks
    before_disk = default_store().get_session("rw").n_cached
    c.rewind(2)
    kept = len(engine.encode_chat(c.messages, add_generation_prompt=False))
    assert 0 < c.num_cached_tokens <= kept  # the kept history stays, nothing past it
    assert engine.pool_stats().used_blocks < before_blocks
    assert default_store().get_session("rw").n_cached == c.num_cached_tokens < before_disk
    c.close()


def test_tier_policy_is_engine_wide_not_set_by_the_last_chat():
    from chatkv.errors import ConfigError

    engine = engine_with()
    with pytest.raises(ConfigError, match="engine-wide"):
        chat(engine, "x", kv_quant="int8")  # would have reconfigured every session of the engine
    assert engine.tiers.config.quant_scheme == "none"
    engine.configure_tiers(TierConfig(quant_scheme="int8", fidelity_floors=NO_GATE))
    chat(engine, "x", kv_quant="int8").close()  # agrees with the engine's own policy
    a = Chat("y", model="tiny:llama", kv_quant="int8", persist=False)
    b = Chat("z", model="tiny:llama", persist=False)
    assert a.engine.tiers.config.quant_scheme == "int8" and b.engine.tiers.config.quant_scheme == "none"
    assert a.engine is not b.engine  # another policy is another engine
    a.close()
    b.close()
