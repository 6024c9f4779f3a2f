"""Compact disk KV: chunks written as quantized blocks, gated by fidelity, restored in place of exact ones."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from chatkv import Chat, EngineConfig, TierConfig, quant
from chatkv.engine import Engine
from chatkv.errors import ConfigError
from chatkv.kvcodec import pack, packed_format, parse_packed, unpack, unpack_into
from chatkv.models import KV_FORMAT_VERSION, load_model
from chatkv.persistence import KVPersister, default_store
from chatkv.quant import bytes_per_token

SCHEMES = ("bf16", "fp16", "int8", "fp8", "int4")
#: Largest error relative to the largest magnitude, per scheme, on Gaussian KV.
TOLERANCE = {"bf16": 1e-2, "fp16": 1e-3, "int8": 1e-2, "fp8": 5e-2, "int4": 0.2}
TURNS = ["Hello there", "Tell me a story", "And then?"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_pack_round_trip_keeps_the_partial_block_exact(scheme: str) -> None:
    kv = torch.randn(3, 2, 4 * 5 + 3, 2, 8, generator=torch.Generator().manual_seed(1))
    tensors = pack(kv, scheme, 4)
    assert torch.equal(tensors["tail"], kv[:, :, 20:])
    back = unpack(tensors, scheme, 4, tuple(kv.shape), torch.float32)
    assert back.shape == kv.shape and torch.equal(back[:, :, 20:], kv[:, :, 20:])
    assert float((back - kv).abs().max()) <= TOLERANCE[scheme] * float(kv.abs().max())
    assert sum(t.numel() * t.element_size() for t in tensors.values()) < kv.numel() * kv.element_size()
    with pytest.raises(ValueError):
        unpack({k: v for k, v in tensors.items() if k != "v.data"}, scheme, 4, tuple(kv.shape), torch.float32)
    with pytest.raises(ValueError):
        unpack(tensors, scheme, 4, (3, 2, 24, 2, 8), torch.float32)


@pytest.mark.parametrize("tile", [None, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_unpacking_into_pool_slices_writes_what_unpack_returns(scheme: str, dtype: torch.dtype, tile: int | None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if tile is not None:  # the CPU's float32 scratch a few tokens at a time, cut mid-layer
        monkeypatch.setattr(quant, "ROW_TILE_ELEMS", tile)
    kv = (3 * torch.randn(3, 2, 37, 2, 16, generator=torch.Generator().manual_seed(2))).to(dtype)
    tensors = pack(kv, scheme, 8)
    want = unpack(tensors, scheme, 8, tuple(kv.shape), dtype)
    pool = torch.full((3, 2, 60, 2, 16), float("nan"), dtype=dtype)
    # Runs of slots out of order, cutting blocks and the quantized/exact boundary (32).
    runs = [(0, slice(5, 15)), (10, slice(30, 50)), (30, slice(0, 5)), (35, slice(55, 57))]
    unpack_into(tensors, scheme, 8, tuple(kv.shape), [(first, pool[:, :, s]) for first, s in runs])
    got = torch.cat([pool[:, :, s] for _, s in runs], dim=2)
    assert torch.equal(got, want)  # bit for bit, NaN-free: every slot written
    assert torch.isnan(pool[:, :, 15:30]).all() and torch.isnan(pool[:, :, 50:55]).all()  # nothing else
    with pytest.raises(ValueError):
        unpack_into({k: v for k, v in tensors.items() if k != "k.data"}, scheme, 8, tuple(kv.shape),
                    [(0, pool[:, :, :37])])


def test_fp8_codes_widen_through_their_bits_exactly() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)  # every code: subnormals, -0, NaN
    half = quant._fp8_as_scaled_half(codes, torch.empty(256, dtype=torch.int16))
    got, want = half.float() * quant.FP8_HALF_SHIFT, codes.float()
    finite = ~want.isnan()
    assert torch.equal(got.view(torch.int32)[finite], want.view(torch.int32)[finite])  # bit for bit, -0 included
    assert got[~finite].abs().tolist() == [480.0, 480.0]  # the NaN codes, which quantize() never writes
    scale = torch.rand(256, generator=torch.Generator().manual_seed(4)) + 1e-3
    q = quant.QuantizedKV(scheme="fp8", kind="k", shape=(1, 1, 256, 1), dtype=torch.float32,
                          data=codes.view(1, 1, 256, 1), scale=scale.view(1, 1, 256))
    assert torch.equal(quant.dequantize(q).view(-1)[finite], (want * scale)[finite])


def test_formats_parse_and_are_checked() -> None:
    base = packed_format(KV_FORMAT_VERSION, "int8", 16)
    assert parse_packed(base, KV_FORMAT_VERSION) == ("int8", 16)
    assert parse_packed(f"{KV_FORMAT_VERSION}:dense", KV_FORMAT_VERSION) is None
    with pytest.raises(ValueError):
        parse_packed(f"{KV_FORMAT_VERSION}:packed-int3.b16", KV_FORMAT_VERSION)
    with pytest.raises(ConfigError, match="disk_format"):
        TierConfig(disk_format="int3")


def test_int8_on_disk_is_at_most_27_percent_of_fp32_for_smollm2() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 channels; fp32 is 46,080 bytes a token.
    exact = bytes_per_token("none", 3, 64, 30, 16, torch.float32)
    assert exact == 46_080
    assert bytes_per_token("int8", 3, 64, 30, 16) <= 0.27 * exact
    assert bytes_per_token("int4", 3, 64, 30, 16) < bytes_per_token("int8", 3, 64, 30, 16)


def _engine(disk_format: str, floors: dict[str, float] | None = None, dtype: torch.dtype = torch.float32) -> Engine:
    floors = floors if floors is not None else {s: 0.0 for s in SCHEMES}  # floor 0: passes without measuring
    tiers = TierConfig(disk_format=disk_format, fidelity_floors=floors)
    return Engine(load_model("tiny:llama", dtype=dtype), EngineConfig(num_blocks=256, block_size=4, tiers=tiers))


def _converse(engine: Engine, sid: str) -> Chat:
    chat = Chat(sid, system="You are terse.", engine=engine, max_new_tokens=8, chunk_tokens=16)
    for text in TURNS:
        chat.send(text)
    return chat


def _chunks(sid: str):
    store = default_store()
    return store.kv_chunks(sid), store.get_session(sid)


@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
def test_a_compact_session_is_smaller_on_disk_and_restores(scheme: str) -> None:
    exact = _converse(_engine("exact"), "exact")
    exact_kv = exact.engine.call(lambda: exact.engine.pool.read_tokens(exact._session.kv.seq, 0,
                                                                       exact.num_cached_tokens).clone())
    exact.close()
    small = _converse(_engine(scheme), "small")
    small.close()
    chunks, info = _chunks("small")
    assert {c.quant for c in chunks} == {scheme} and all(":packed-" in c.kv_format for c in chunks)
    exact_chunks, exact_info = _chunks("exact")
    assert {c.quant for c in exact_chunks} == {"none"}
    assert info.n_cached == exact_info.n_cached
    ratio = info.kv_bytes / exact_info.kv_bytes
    assert ratio < {"int8": 0.45, "int4": 0.42, "bf16": 0.6}[scheme], ratio  # tiny heads, file headers

    again = Chat("small", engine=_engine(scheme), max_new_tokens=8, chunk_tokens=16)
    restored = again.wait_restored()
    assert restored.source == "disk" and restored.cached_tokens == info.n_cached
    kv = again.engine.call(lambda: again.engine.pool.read_tokens(again._session.kv.seq, 0, info.n_cached).clone())
    err = float((kv - exact_kv).abs().max()) / float(exact_kv.abs().max())
    assert 0 < err <= TOLERANCE[scheme] * 2, err  # lossy, within the scheme's error (KV made from lossy KV too)
    again.send("One more.")
    assert again.last_stats.reused_tokens > info.n_cached // 2  # (the tiny tokenizer re-splits a reply's end)
    again.close()


@pytest.mark.parametrize("from_disk", [False, True])
def test_a_compact_restore_on_the_cpu_dequantizes_with_the_readers_idle(from_disk: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # The loop's operators and the reader threads on the same cores made both
    # several times slower: on a host pool the loop writes compact chunks into
    # the pool (without the native reads, which dequantize them in the
    # readers) only while no chunk is being read (from the page cache: reads
    # that wait for the disk leave the cores free).
    from chatkv.storage import nativeread

    monkeypatch.setattr(nativeread, "reader", lambda: None)
    exact = _converse(_engine("exact"), "exact-idle")
    want = exact.engine.call(lambda: exact.engine.pool.read_tokens(exact._session.kv.seq, 0,
                                                                   exact.num_cached_tokens).clone())
    exact.close()
    _converse(_engine("int4"), "int4-idle").close()
    chunks, info = _chunks("int4-idle")
    assert len(chunks) >= 3
    reading = []  # one entry per read in flight
    seen: list[int] = []  # reads in flight as each fill began

    def read_chunk(self, *args):  # type: ignore[no-untyped-def]
        reading.append(1)
        try:
            tensors, _ = original_read(self, *args)
            return tensors, from_disk  # as if from the page cache or the disk, however long the read took
        finally:
            reading.pop()

    def fill(self, *args):  # type: ignore[no-untyped-def]
        seen.append(len(reading))
        return original_fill(self, *args)

    original_read, original_fill = KVPersister._read_chunk, KVPersister._fill
    monkeypatch.setattr(KVPersister, "_read_chunk", read_chunk)
    monkeypatch.setattr(KVPersister, "_fill", fill)
    again = Chat("int4-idle", engine=_engine("int4"), max_new_tokens=8, chunk_tokens=16)
    restored = again.wait_restored()
    assert restored.source == "disk" and restored.cached_tokens == info.n_cached and not restored.warning
    assert len(seen) >= len(chunks) - 1  # (the last chunk may be a dense tail)
    if not from_disk:  # (from the disk, each chunk is written as it comes, beside the next reads)
        assert seen == [0] * len(seen)
    got = again.engine.call(lambda: again.engine.pool.read_tokens(again._session.kv.seq, 0, info.n_cached).clone())
    assert float((got - want).abs().max()) <= TOLERANCE["int4"] * 2 * float(want.abs().max())
    again.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_compact_chunk_is_dequantized_into_its_slots_as_it_is_read(scheme: str, dtype: torch.dtype,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     native_reads) -> None:
    """With the native reads, the reader threads write a compact chunk
    straight into its slots, dequantized as it lands (the loop fills none of
    them): bit for bit what the loop's fill writes without them, for a
    session read whole and for one whose start another session holds (its
    shared tokens' codes read, checked and not written)."""
    from chatkv.storage import nativeread

    reads = native_reads
    for sid, first in (("a", "Hello there"), ("b", "Hello there, how are you today, my friend?")):
        chat = Chat(f"{scheme}-{sid}", system="You are terse.", engine=_engine(scheme, dtype=dtype),
                    max_new_tokens=8, chunk_tokens=16)
        for text in (first, *TURNS[1:]):
            chat.send(text)
        chat.close()
    fills: list[int] = []
    shared: list[int] = []
    original_fill, original_converted = KVPersister._fill, KVPersister._converted
    monkeypatch.setattr(KVPersister, "_fill", lambda self, *a: fills.append(1) or original_fill(self, *a))
    monkeypatch.setattr(KVPersister, "_converted",
                        lambda self, source, base, shape, into: shared.append(into[1])
                        or original_converted(self, source, base, shape, into))
    got = {}
    for native in (False, True):
        monkeypatch.setattr(nativeread, "reader", (lambda: reads) if native else (lambda: None))
        fills.clear()
        engine = _engine(scheme, dtype=dtype)
        chats, kv = [], {}
        for sid in ("a", "live", "b"):  # "b" shares its first blocks with "live" (exact KV: shareable)
            chat = Chat(f"{scheme}-{sid}-{native}" if sid == "live" else f"{scheme}-{sid}", system="You are terse.",
                        engine=engine, max_new_tokens=8, chunk_tokens=16)
            chats.append(chat)
            if sid == "live":
                chat.send("Hello there")
                continue
            restored = chat.wait_restored()
            assert restored.source == "disk" and restored.cached_tokens > 16 and not restored.warning
            seq = chat._session.kv.seq
            kv[sid] = engine.call(lambda: engine.pool.read_tokens(seq, 0, seq.num_computed).clone())
        got[native] = kv, len(fills)
        for chat in chats:
            chat.close()
    (plain, loop_fills), (native_kv, native_fills) = got[False], got[True]
    packed = any(":packed-" in c.kv_format for c in _chunks(f"{scheme}-b")[0])
    assert packed == (scheme not in ("bf16", "fp16") or dtype != torch.bfloat16)  # (a bfloat16 model's are exact)
    assert (loop_fills > 0) == packed and native_fills == 0
    assert any(shared) == packed, shared  # a chunk read past a shared prefix
    for sid in ("a", "b"):
        assert torch.equal(native_kv[sid].view(torch.uint8), plain[sid].view(torch.uint8))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_corrupt_compact_chunk_keeps_the_chunks_before_it(scheme: str) -> None:
    _converse(_engine(scheme), "damaged").close()
    store = default_store()
    chunks, info = _chunks("damaged")
    assert len(chunks) >= 4
    path = store.path_of(chunks[2])
    data = path.read_bytes()
    path.write_bytes(data[:-20] + bytes(b ^ 0xFF for b in data[-20:]))
    again = Chat("damaged", engine=_engine(scheme), max_new_tokens=8, chunk_tokens=16)
    restored = again.wait_restored()
    assert "checksum mismatch" in restored.warning
    assert restored.cached_tokens == chunks[0].n_tokens + chunks[1].n_tokens  # the two before it count
    again.send("One more.")  # re-prefills the rest, and says why
    assert again.last_stats.reused_tokens == restored.cached_tokens
    assert "quarantined" in again.last_stats.not_reused
    again.close()


def test_the_gate_refuses_a_format_below_its_floor() -> None:
    engine = _engine("int4", floors={s: 1.01 for s in SCHEMES})  # nothing can reach 101 %
    assert engine.call(engine.tiers.effective_disk_scheme) == "none"
    _converse(engine, "gated").close()
    chunks, _ = _chunks("gated")
    assert {c.quant for c in chunks} == {"none"} and all(":dense" in c.kv_format for c in chunks)


@pytest.mark.parametrize("scheme", ["bf16", "fp16"])
def test_a_cast_that_saves_no_bytes_is_exact(scheme: str) -> None:
    """bf16 and fp16 chunks of a bfloat16 model's KV would be as large as
    its exact ones, and fp16 would lose range: its chunks are written exact
    (dense, the session exact when restored); a float32 model's are cast."""
    engine = _engine(scheme, dtype=torch.bfloat16)
    assert engine.call(engine.tiers.effective_disk_scheme) == "none"
    _converse(engine, f"cast-{scheme}").close()
    chunks, _ = _chunks(f"cast-{scheme}")
    assert {c.quant for c in chunks} == {"none"} and all(":dense" in c.kv_format for c in chunks)
    again = Chat(f"cast-{scheme}", engine=_engine(scheme, dtype=torch.bfloat16), max_new_tokens=8, chunk_tokens=16)
    assert again.wait_restored().source == "disk" and again._session.kv.seq.exact
    again.close()
    wide = _engine(scheme)
    assert wide.call(wide.tiers.effective_disk_scheme) == scheme


# A fresh interpreter: its main thread has run no torch operator yet (pytest's has).
_POOL_PROBE = """
import os, tempfile, threading
from chatkv import Chat, EngineConfig, TierConfig
from chatkv.engine import Engine
from chatkv.models import load_model
from chatkv.storage import Store

def native():  # OS threads that are not Python's: OpenMP workers among them
    return len(os.listdir("/proc/self/task")) - threading.active_count()

engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=256, block_size=4))
engine.wait_warm()
with tempfile.TemporaryDirectory() as home:
    store = Store(home)
    chat = Chat("s", engine=engine, store=store, max_new_tokens=4)
    for text in ("Hello there", "Tell me a story"):  # exact chunks: whatever a first turn starts
        chat.send(text)
    before = native()
    engine.tiers.configure(TierConfig(disk_format="int8", fidelity_floors={"int8": 0.0}))
    for text in ("And then?", "One more."):  # int8 chunks, quantized when this thread saves
        chat.send(text)
    chat.close()
    assert "packed-int8" in str([c.kv_format for c in store.kv_chunks("s")])
    print("threads", before, native())
    store.close()
engine.close()
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_saving_compact_chunks_leaves_the_callers_thread_without_an_openmp_pool() -> None:
    # libgomp gives each thread that runs a parallel torch operator a pool for good; a
    # second pool beside the loop's makes every operator of the loop several times slower.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", _POOL_PROBE], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = (int(x) for x in done.stdout.split("threads")[-1].split())
    assert after == before
