from __future__ import annotations

from pathlib import Path

import pytest
import torch
from chatkv.storage import (
    ChunkMeta,
    CorruptChunkError,
    FingerprintMismatchError,
    MissingChunkError,
    NewChunk,
    Store,
    chunk_hash,
)
from safetensors import safe_open

from .conftest import BLOCK, CHUNK, FP, META, kv_files, kv_for, new_chunks


def _turn(store: Store, sid: str, ids: list[int]):
    """Save like the engine does: keep the full chunks already stored, write the rest."""
    keep = [c for c in store.kv_chunks(sid) if c.n_tokens == CHUNK]
    keep = keep[: min(len(keep), len(ids) // CHUNK)]
    return store.save_kv(sid, token_ids=ids, fingerprint=FP, chunks=[c.hash for c in keep] + new_chunks(ids, CHUNK * len(keep)))


def test_chunk_file_metadata_and_roundtrip(store: Store, home: Path) -> None:
    ids = list(range(40))
    meta = ChunkMeta(FP, "paged-v1", "bfloat16", 16, "int8", extra={"group": "32"})
    t = {"k": torch.randn(2, 3, 16, 2, 8).to(torch.bfloat16), "scale": torch.rand(2, 3), "mask": torch.ones(4, dtype=torch.bool)}
    info = store.write_chunk(ids, t, meta)
    assert info.hash == chunk_hash(None, ids, FP, "paged-v1") and info.written == info.bytes > 0
    path = home / "kv" / info.hash[:2] / f"{info.hash}.safetensors"
    assert store.path_of(info) == path and path.exists()
    with safe_open(str(path), framework="pt") as f:
        md = f.metadata()
    assert md["format"] == "chatkv.kv_chunk" and md["format_version"] == "1"
    assert (md["fingerprint"], md["dtype"], md["block_size"], md["n_tokens"], md["quant"]) == (FP, "bfloat16", "16", "40", "int8")
    assert md["chunk_hash"] == info.hash and md["parent"] == "" and md["x.group"] == "32"
    assert md["checksum"].startswith("xxh3_128:") and int(md["payload_bytes"]) > 0
    store.open_session("s")
    store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=[info.hash])
    back = store.read_chunk(info.hash, fingerprint=FP)
    assert back.token_ids == ids and set(back.tensors) == set(t)
    for k in t:
        assert back.tensors[k].dtype == t[k].dtype and torch.equal(back.tensors[k], t[k])
    # a view into a bigger buffer (as a pool slice would be) is stored as itself
    pool = torch.randn(8, 16, 2, 8)
    info2 = store.write_chunk([1, 2], {"kv": pool[2:4]}, META)
    store.save_kv("s", token_ids=[1, 2], fingerprint=FP, chunks=[info2])
    assert torch.equal(store.read_chunk(info2.hash).tensors["kv"], pool[2:4])


def test_shared_system_prompt_is_stored_once_across_10_sessions(store: Store, home: Path) -> None:
    system = list(range(100, 100 + 2 * CHUNK))  # two full chunks of system prompt
    saves = []
    for i in range(10):
        sid = f"user-{i}"
        store.open_session(sid, fingerprint=FP)
        ids = system + [9000 + i] * 10  # each session's own tail
        saves.append(store.save_kv(sid, token_ids=ids, fingerprint=FP, chunks=new_chunks(ids)))
    files = kv_files(home)
    assert len(files) == 2 + 10  # 2 shared chunks + 10 tails
    shared_bytes = sum(c.bytes for c in saves[0].chunks[:2])
    tail_bytes = sum(s.chunks[2].bytes for s in saves)
    assert sum(p.stat().st_size for p in files) == shared_bytes + tail_bytes
    assert saves[0].bytes_written == shared_bytes + saves[0].chunks[2].bytes
    for s in saves[1:]:  # later sessions only wrote their tail
        assert s.bytes_written == s.chunks[2].bytes and s.files_written == 1
    sb = store.session_bytes("user-3")
    assert sb.total == shared_bytes + saves[3].chunks[2].bytes and sb.shared == shared_bytes
    assert store.disk_usage().indexed_bytes == store.disk_usage().file_bytes == shared_bytes + tail_bytes


def test_saving_turn_k_writes_only_the_chunks_it_completed(store: Store, home: Path) -> None:
    store.open_session("long", fingerprint=FP)
    ids: list[int] = []
    sizes = []
    for k in range(6):
        ids = ids + list(range(len(ids), len(ids) + 50))  # 50 new tokens per turn
        before = store.bytes_written
        r = _turn(store, "long", ids)
        new = [c for c in r.chunks if c.written]
        assert store.bytes_written - before == r.bytes_written == sum(c.bytes for c in new)
        full_before = (len(ids) - 50) // CHUNK
        # new files = chunks completed this turn + the new tail; the old prefix is untouched
        assert all(c.n_tokens == CHUNK for c in r.chunks[:-1])
        assert len(new) == len(r.chunks) - full_before
        sizes.append(r.bytes_written)
        assert len(kv_files(home)) == len(r.chunks)  # old tails were removed
    assert max(sizes) < 3 * sizes[0]  # cost per turn does not grow with the history
    kv = store.load_kv("long", fingerprint=FP)
    assert kv.token_ids == ids and store.get_session("long").n_cached == len(ids) == 300


def test_load_kv_returns_tensors_in_order(store: Store) -> None:
    ids = list(range(150))
    store.open_session("s")
    store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    kv = store.load_kv("s", fingerprint=FP)
    assert [c.info.n_tokens for c in kv.chunks] == [64, 64, 22]
    for c in kv.chunks:
        assert torch.equal(c.tensors["kv"], kv_for(c.token_ids)["kv"])


def test_save_kv_rejects_chunks_that_do_not_chain_over_the_tokens(store: Store) -> None:
    store.open_session("s")
    ids = list(range(128))
    r = store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    with pytest.raises(ValueError, match="does not match"):
        store.save_kv("s", token_ids=[7] + ids[1:], fingerprint=FP, chunks=[c.hash for c in r.chunks])
    with pytest.raises(ValueError, match="cover 64 tokens"):
        store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=[r.chunks[0].hash])
    with pytest.raises(ValueError):
        store.save_kv("s", token_ids=ids[64:], fingerprint=FP, chunks=[r.chunks[1].hash])  # wrong parent
    with pytest.raises(MissingChunkError):
        store.save_kv("s", token_ids=ids[:3], fingerprint=FP, chunks=["ab" * 32])
    assert store.load_kv("s").token_ids == ids  # failed saves changed nothing


def test_fingerprint_mismatch_and_invalidate_keep_history(store: Store, home: Path) -> None:
    store.open_session("s", fingerprint=FP)
    store.append_message("s", "user", "hello")
    ids = list(range(70))
    store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    with pytest.raises(FingerprintMismatchError, match="re-prefilled"):
        store.load_kv("s", fingerprint="another-model")
    res = store.invalidate_kv("s")
    assert res.files_removed == 2 and kv_files(home) == []
    info = store.get_session("s")
    assert (info.n_cached, info.n_chunks, info.kv_bytes, info.fingerprint) == (0, 0, 0, None)
    assert [m.content for m in store.messages("s")] == ["hello"]
    assert store.load_kv("s", fingerprint="another-model").chunks == []


def _corrupt_flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[-5] ^= 0xFF
    p.write_bytes(bytes(b))


def _corrupt_truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-100])


def _corrupt_header(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[10:20] = b"x" * 10
    p.write_bytes(bytes(b))


def _read_into_buffers(store: Store, sid: str, fingerprint: str | None = None) -> None:
    """Read a session's KV the way a restore does: each chunk straight into caller memory."""
    for source in store.open_kv(sid, fingerprint=fingerprint):
        dtype, shape = source.shapes["kv"]
        dest = torch.empty(shape, dtype=dtype)
        source.read_into({"kv": [dest.view(-1).view(torch.uint8).numpy().data]})


@pytest.mark.parametrize("read", ["load_kv", "open_kv"])
@pytest.mark.parametrize("damage", [_corrupt_flip, _corrupt_truncate, _corrupt_header, Path.unlink])
def test_corrupt_or_missing_chunk_is_quarantined_and_history_survives(store: Store, home: Path, damage,
                                                                       read: str, chunk_reads) -> None:
    store.open_session("s", fingerprint=FP)
    store.open_session("t", fingerprint=FP)
    for i in range(3):
        store.append_message("s", "user", f"m{i}")
    ids = list(range(200))
    r = store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    store.save_kv("t", token_ids=ids[:128], fingerprint=FP, chunks=[c.hash for c in r.chunks[:2]])
    bad = r.chunks[1]
    damage(store.path_of(bad))
    with pytest.raises(CorruptChunkError) as ei:
        if read == "load_kv":
            store.load_kv("s", fingerprint=FP)
        else:
            _read_into_buffers(store, "s", fingerprint=FP)
    assert ei.value.chunk_hash == bad.hash and ei.value.sessions == ("s", "t")
    if damage is Path.unlink:
        assert isinstance(ei.value, MissingChunkError)
    else:
        assert [p.name.split(".")[0] for p in (home / "quarantine").iterdir()] == [bad.hash]
    assert not store.path_of(bad).exists() and not store.has_chunk(bad.hash)
    # both sessions keep the valid prefix before the bad chunk; the chunks after it are gone
    for sid in ("s", "t"):
        kv = store.load_kv(sid, fingerprint=FP)
        assert kv.token_ids == ids[:64] and store.get_session(sid).n_cached == 64
    assert [p.name for p in kv_files(home)] == [f"{r.chunks[0].hash}.safetensors"]
    assert [m.content for m in store.messages("s")] == ["m0", "m1", "m2"]
    # and the session can be saved again in full
    store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=[r.chunks[0].hash] + new_chunks(ids, 64))
    assert store.load_kv("s").token_ids == ids


def test_a_file_swapped_for_another_valid_chunk_is_detected(store: Store) -> None:
    store.open_session("s")
    ids = list(range(128))
    r = store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    a, b = (store.path_of(c) for c in r.chunks)
    b.write_bytes(a.read_bytes())  # same size, valid file, wrong content
    with pytest.raises(CorruptChunkError, match="size is|says it is chunk"):
        store.load_kv("s")


def test_verify_chunks_reports_and_quarantines(store: Store) -> None:
    store.open_session("s")
    ids = list(range(128))
    r = store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    assert store.verify_chunks() == []
    _corrupt_flip(store.path_of(r.chunks[0]))
    bad = store.verify_chunks()
    assert [e.chunk_hash for e in bad] == [r.chunks[0].hash]
    assert store.get_session("s").n_cached == 0


def test_dedup_skips_rewrite_but_heals_a_truncated_indexed_file(store: Store) -> None:
    ids = list(range(64))
    store.open_session("s")
    r = store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    again = store.write_chunk(ids, kv_for(ids), META)
    assert again.written == 0
    p = store.path_of(again)
    p.write_bytes(p.read_bytes()[:50])
    healed = store.write_chunk(ids, kv_for(ids), META)
    assert healed.written == healed.bytes == r.chunks[0].bytes
    assert store.load_kv("s").token_ids == ids


def test_new_chunk_with_wrong_fingerprint_is_refused(store: Store) -> None:
    store.open_session("s")
    other = ChunkMeta("other", "paged-v1", "float32", 16)
    with pytest.raises(ValueError, match="fingerprint"):
        store.save_kv("s", token_ids=[1, 2], fingerprint=FP, chunks=[NewChunk(2, kv_for([1, 2]), other)])


def test_files_checksummed_with_sha256_still_verify(tmp_path) -> None:
    """Chunks written with the older sha256 checksum are read and verified as before."""
    import torch

    from chatkv.storage import ChunkMeta, Store
    from chatkv.storage import chunkfile

    store = Store(tmp_path / "home")
    meta = ChunkMeta(fingerprint="fp", kv_format="dense", dtype="float32", block_size=4)
    old = chunkfile.CHECKSUM_ALGORITHM
    chunkfile.CHECKSUM_ALGORITHM = "sha256"
    try:
        info = store.write_chunk([1, 2, 3, 4], {"kv": torch.arange(8.0)}, meta)
    finally:
        chunkfile.CHECKSUM_ALGORITHM = old
    got = chunkfile.read_chunk_file(store.path_of(info), info.hash, fingerprint="fp")
    assert got.metadata["checksum"].startswith("sha256:")
    assert torch.equal(got.tensors["kv"], torch.arange(8.0))
    store.close()


def test_open_kv_reads_each_chunk_straight_into_the_callers_buffers(store: Store, chunk_reads) -> None:
    """What a restore does: the index read once, each chunk's tensor read into
    caller memory cut into pieces (a pool's rows, with room for skipped tokens),
    in Python and through the native call alike."""
    ids = list(range(150))
    store.open_session("s")
    store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    kv = store.open_kv("s", fingerprint=FP)
    assert kv.token_ids == ids and [c.n_tokens for c in kv.chunks] == [64, 64, 22]
    pool = torch.zeros(2, 2, 40, BLOCK, 2, 8)  # [layers, k/v, blocks, block size, heads, dim]
    seen = []
    for source in kv:
        n = source.info.n_tokens
        dtype, shape = source.shapes["kv"]
        assert dtype == torch.float32 and shape == (2, 2, -(-n // BLOCK), BLOCK, 2, 8)
        assert source.token_ids == ids[sum(seen): sum(seen) + n]
        # Every layer and K/V row in its own piece, far apart in the pool, each split once more.
        first = 10 * len(seen)
        rows = [pool[layer, i, first: first + shape[2]].view(-1).view(torch.uint8).numpy().data.cast("B")
                for layer in range(2) for i in range(2)]
        buffers = [piece for row in rows for piece in (row[:100], row[100:])]
        assert source.read_into({"kv": buffers}) == {}
        want = kv_for(source.token_ids)["kv"]
        assert torch.equal(pool[:, :, first: first + shape[2]], want)
        seen.append(n)
    assert seen == [64, 64, 22]
    assert chunk_reads.native_calls == (3 if chunk_reads.path == "native" else 0)


def test_read_into_spans_lands_each_stretch_where_it_says(store: Store, chunk_reads) -> None:
    """A tensor read into Spans (stretches of one buffer, out of order, empty
    ones among them) lands as it would in a view per stretch, in Python and
    through the native call; spans outside their buffer or over read-only
    memory are refused before anything is read."""
    import numpy as np

    from chatkv.storage import Spans

    kv = torch.randn(6, 10)
    store.open_session("s")
    store.save_kv("s", token_ids=list(range(20)), fingerprint=FP, chunks=[NewChunk(20, {"kv": kv}, META)])
    memory = bytearray(1000)
    offsets, sizes = np.array([800, 0, 40, 500, 960], dtype=np.int64), np.array([80, 40, 0, 80, 40], dtype=np.int64)
    (source,) = list(store.open_kv("s"))
    assert source.read_into({"kv": Spans(memory, offsets, sizes)}) == {}
    data = kv.numpy().tobytes()
    landed = b"".join(bytes(memory[o: o + n]) for o, n in zip(offsets, sizes))
    assert landed == data and memory[120:500] == bytearray(380)  # nothing outside the stretches
    for bad, error in ((Spans(memory, offsets + 100, sizes), ValueError),  # the last stretch past the end
                       (Spans(memory, offsets - 41, sizes), ValueError),  # one before the start
                       (Spans(bytes(1000), offsets, sizes), TypeError)):
        before = bytes(memory)
        (source,) = list(store.open_kv("s"))
        with pytest.raises(error):
            source.read_into({"kv": bad})
        assert bytes(memory) == before
    assert chunk_reads.native_calls == (4 if chunk_reads.path == "native" else 0)  # (the refusals among them)


def test_converted_spans_convert_as_buffers_do(store: Store, chunk_reads) -> None:
    """int8 codes converted into Spans (whole rows per stretch, out of order)
    hold what they hold converted into a view per stretch; a stretch of
    partial rows is refused."""
    import numpy as np

    from chatkv.storage import Converted, Spans

    if chunk_reads.path == "python":
        pytest.skip("conversions need the native reads")
    codes = torch.randint(-127, 128, (6, 8), dtype=torch.int8)
    scale = torch.rand(6) / 100
    store.open_session("s")
    store.save_kv("s", token_ids=list(range(20)), fingerprint=FP,
                  chunks=[NewChunk(20, {"codes": codes, "scale": scale}, META)])
    row = 8 * 2  # bfloat16 bytes a row
    memory = bytearray(12 * row)
    offsets = np.array([9 * row, 0, 4 * row], dtype=np.int64)
    sizes = np.array([2 * row, 3 * row, row], dtype=np.int64)
    (source,) = list(store.open_kv("s"))
    fresh = source.read_into({}, converted={"codes": Converted(Spans(memory, offsets, sizes), torch.bfloat16, 8,
                                                              "scale")})
    assert set(fresh) == {"scale"}
    want = (codes.float() * scale[:, None]).to(torch.bfloat16)
    got = torch.frombuffer(memory, dtype=torch.bfloat16).view(12, 8)
    assert torch.equal(torch.cat([got[9:11], got[0:3], got[4:5]]), want)
    (source,) = list(store.open_kv("s"))
    partial = Spans(memory, np.array([0, 100], dtype=np.int64), np.array([row + 2, 5 * row - 2], dtype=np.int64))
    with pytest.raises(ValueError, match="whole rows"):
        source.read_into({}, converted={"codes": Converted(partial, torch.bfloat16, 8, "scale")})


def test_templated_converted_reads_match_reads_built_afresh(store: Store, chunk_reads) -> None:
    """A converted read into PlaneSpans (a restore's: worked out once per
    layout, then only filled in) lands what the same read into plain buffers
    lands, for two chunks of one layout whose headers differ in length (the
    second has a parent); its scales and other tensors come back read; a
    flipped code is a checksum mismatch; a destination of partial rows is
    refused before anything is read."""
    from chatkv.storage import Converted, Planes
    from chatkv.storage import chunkfile as cf

    if chunk_reads.path == "python":
        pytest.skip("conversions need the native reads")
    cf._TEMPLATED.clear()
    codes = [torch.randint(-127, 128, (6, 8), dtype=torch.int8) for _ in range(2)]
    scales = [torch.rand(6) / 100 for _ in range(2)]
    extra = torch.arange(5, dtype=torch.int32)
    store.open_session("s")
    r = store.save_kv("s", token_ids=list(range(40)), fingerprint=FP, chunks=[
        NewChunk(20, {"codes": c, "scale": sc, "extra": extra, "tail": torch.zeros(0, 8, dtype=torch.bfloat16)},
                 META) for c, sc in zip(codes, scales)])
    row = 8 * 2  # bfloat16 bytes a row
    runs = [(9 * row, 11 * row), (0, 3 * row), (4 * row, 5 * row)]  # six rows, out of order
    memory = bytearray(2 * 12 * row)
    planes = Planes(memory, [0, 12 * row], runs)
    sources = list(store.open_kv("s"))
    assert sources[0]._reader._base != sources[1]._reader._base
    for i, source in enumerate(sources):
        fresh = source.read_into({"tail": []}, converted={
            "codes": Converted(planes.span(0, 6 * row, i, 2), torch.bfloat16, 8, "scale")})
        assert set(fresh) == {"scale", "extra"} and torch.equal(fresh["scale"], scales[i])
        assert torch.equal(fresh["extra"], extra)
        got = torch.frombuffer(memory, dtype=torch.bfloat16).view(2, 12, 8)[i]
        want = (codes[i].float() * scales[i][:, None]).to(torch.bfloat16)
        assert torch.equal(torch.cat([got[9:11], got[0:3], got[4:5]]), want)
    assert chunk_reads.templated_calls == 2 and chunk_reads.native_calls == 0 and len(cf._TEMPLATED) == 1
    # The same reads built afresh (plain buffers), into memory of their own: the same bytes.
    plain = bytearray(2 * 12 * row)
    for i, source in enumerate(store.open_kv("s")):
        views = [memoryview(plain)[i * 12 * row + a: i * 12 * row + b] for a, b in runs]
        source.read_into({"tail": []}, converted={"codes": Converted(views, torch.bfloat16, 8, "scale")})
    assert plain == memory and chunk_reads.native_calls == 2
    partial = Planes(memory, [0, 12 * row], [(0, row + 2), (100, 5 * row + 100 - 2)])
    before = bytes(memory)
    (source, _) = list(store.open_kv("s"))
    with pytest.raises(ValueError, match="whole rows"):
        source.read_into({"tail": []}, converted={
            "codes": Converted(partial.span(0, 6 * row, 0, 2), torch.bfloat16, 8, "scale")})
    assert bytes(memory) == before and chunk_reads.templated_calls == 2
    path = store.path_of(r.chunks[1])
    data = bytearray(path.read_bytes())
    data[data.find(codes[1].numpy().tobytes()) + 9] ^= 0x01
    path.write_bytes(bytes(data))
    (_, source) = list(store.open_kv("s"))
    with pytest.raises(CorruptChunkError, match="checksum mismatch"):
        source.read_into({"tail": []}, converted={
            "codes": Converted(planes.span(0, 6 * row, 1, 2), torch.bfloat16, 8, "scale")})
    assert chunk_reads.templated_calls == 3


def test_converted_reads_read_the_file_front_to_back(store: Store, chunk_reads, monkeypatch) -> None:
    """A converted read reads its chunk's file in order of offset, the
    scales and offsets first (as they lie in the file, not as a set
    iterates them), then the codes: built afresh and templated alike. (Read
    cold, a file read so comes into the page cache in large folios.)"""
    from chatkv.storage import Converted, Planes, nativeread
    from chatkv.storage import chunkfile as cf

    if chunk_reads.path == "python":
        pytest.skip("conversions need the native reads")
    cf._TEMPLATED.clear()
    names = "abcdefgh"  # eight scales: read in any other order, 1 chance in 40,320 of passing
    tensors = {}
    for n in names:
        tensors[f"{n}.data"] = torch.randint(-127, 128, (6, 8), dtype=torch.int8)
        tensors[f"{n}.scale"] = torch.rand(6) / 100
    store.open_session("s")
    store.save_kv("s", token_ids=list(range(40)), fingerprint=FP, chunks=[NewChunk(20, tensors, META)] * 2)
    reads = nativeread.reader()
    offsets: list[list[int]] = []
    real = reads.read_fields

    def recorded(fd, fields, slice_bytes):
        offsets.append([fields[i + 2] for i in range(0, len(fields), nativeread._PIECE_FIELDS)
                        if fields[i + 2] >= 0])
        return real(fd, fields, slice_bytes)

    monkeypatch.setattr(reads, "read_fields", recorded)
    row = 8 * 2
    memory = bytearray(len(names) * 6 * row)
    planes = Planes(memory, [i * 6 * row for i in range(len(names))], [(0, 6 * row)])
    plain = bytearray(len(memory))
    for i, source in enumerate(store.open_kv("s")):
        scale_at = sorted(source._reader._spans[f"{n}.scale"][0] for n in names)
        data_at = sorted(source._reader._spans[f"{n}.data"][0] for n in names)
        assert scale_at[-1] < data_at[0]  # (the layout this test means: safetensors puts float32 first)
        views = [memoryview(plain)[j * 6 * row: (j + 1) * 6 * row] for j in range(len(names))]
        source.read_into({}, converted={f"{n}.data": Converted(
            planes.span(0, 6 * row, j, len(names)) if i else [views[j]], torch.bfloat16, 8, f"{n}.scale")
            for j, n in enumerate(names)})
        assert offsets[-1] == scale_at + data_at, "afresh" if i == 0 else "templated"
    assert chunk_reads.templated_calls == 1 and memory == plain


def test_a_chunk_read_into_memory_is_read_front_to_back(store: Store, chunk_reads, monkeypatch) -> None:
    """A chunk read into memory (a pool not in host memory, a chunk the
    loop fills) reads its file in order of offset, in Python and through the
    native call: the scales first, though the checksum takes each tensor's
    codes before its scales; the tensors and the checksum's verdict are
    unchanged (a flipped scale is found)."""
    import os

    from chatkv.storage import nativeread

    names = "abcd"
    tensors = {}
    for n in names:
        tensors[f"{n}.data"] = torch.randint(-127, 128, (6, 8), dtype=torch.int8)
        tensors[f"{n}.scale"] = torch.rand(6) / 100
    store.open_session("s")
    r = store.save_kv("s", token_ids=list(range(20)), fingerprint=FP, chunks=[NewChunk(20, tensors, META)])
    offsets: list[int] = []
    if chunk_reads.path == "native":
        reads = nativeread.reader()
        real = reads.read_fields

        def recorded(fd, fields, slice_bytes):
            offsets.extend(fields[i + 2] for i in range(0, len(fields), nativeread._PIECE_FIELDS)
                           if fields[i + 2] >= 0)
            return real(fd, fields, slice_bytes)

        monkeypatch.setattr(reads, "read_fields", recorded)
    else:
        real_preadv = os.preadv

        def recorded_preadv(fd, bufs, offset, *args):
            offsets.append(offset)
            return real_preadv(fd, bufs, offset, *args)

        monkeypatch.setattr(os, "preadv", recorded_preadv)
    (source,) = list(store.open_kv("s"))
    spans = source._reader._spans
    fresh = source.read_into({})
    assert all(torch.equal(fresh[name], t) for name, t in tensors.items())
    firsts = [at for at in offsets if at in {spans[name][0] for name in spans}]
    assert firsts == sorted(firsts) and len(firsts) == len(tensors)
    assert offsets == sorted(offsets)
    monkeypatch.undo()
    path = store.path_of(r.chunks[0])
    data = bytearray(path.read_bytes())
    data[data.find(tensors["c.scale"].numpy().tobytes()) + 2] ^= 0x01
    path.write_bytes(bytes(data))
    (source,) = list(store.open_kv("s"))
    with pytest.raises(CorruptChunkError, match="checksum mismatch"):
        source.read_into({})


def test_chunks_read_or_refused_leave_no_file_open(store: Store, chunk_reads) -> None:
    """Each chunk's file is closed once it is read, refused before reading,
    or found corrupt."""
    import os

    def open_files() -> set[tuple[str, str]]:
        """The process's open descriptors with what each names; not the one
        the listing itself used (gone by the time it is named)."""
        out = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
            except FileNotFoundError:
                pass
        return out

    ids = list(range(60))
    store.open_session("s")
    store.save_kv("s", token_ids=ids, fingerprint=FP,
                  chunks=[NewChunk(20, {"kv": torch.randn(2, 3, 20)}, META) for _ in range(3)])
    before = open_files()
    _read_into_buffers(store, "s")
    for source in store.open_kv("s"):
        with pytest.raises(ValueError):
            source.read_into({"kv": [bytearray(8)]})
    sources = list(store.open_kv("s"))
    path = store.path_of(sources[1].info)
    data = bytearray(Path(path).read_bytes())
    data[sources[1]._reader._spans["kv"][0] + 5] ^= 0xFF  # a byte of its KV: the checksum fails
    Path(path).write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError):
        for source in sources:
            dtype, shape = source.shapes["kv"]
            source.read_into({"kv": [torch.empty(shape, dtype=dtype).view(-1).view(torch.uint8).numpy().data]})
    for source in sources:
        source.close()
    # (Opened since and still open: a descriptor an earlier test left to the
    # garbage collector may close meanwhile, which is not this test's business.)
    assert open_files() - before == set()


def test_open_kv_refuses_buffers_that_do_not_fit_and_reads_other_tensors_anew(store: Store, chunk_reads) -> None:
    ids = list(range(20))
    extra = {"kv": torch.randn(2, 3), "scale": torch.rand(5)}
    store.open_session("s")
    store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=[NewChunk(20, extra, META)])
    (source,) = list(store.open_kv("s"))
    with pytest.raises(ValueError, match="hold 8 bytes, the tensor 24"):
        source.read_into({"kv": [bytearray(8)]})
    with pytest.raises(ValueError, match="no tensor"):
        source.read_into({"missing": [bytearray(8)]})
    for source in store.open_kv("s"):
        dest = bytearray(24)
        fresh = source.read_into({"kv": [dest]})
        assert set(fresh) == {"scale"} and torch.equal(fresh["scale"], extra["scale"])
        assert torch.equal(torch.frombuffer(dest, dtype=torch.float32).view(2, 3), extra["kv"])


@pytest.mark.parametrize("slice_bytes", [1 << 20, 96, 7])
def test_read_into_hashes_slice_by_slice_with_the_same_bytes_and_verdict(store: Store, monkeypatch,
                                                                         slice_bytes: int, chunk_reads) -> None:
    """A chunk read a slice at a time, each slice hashed as it lands (slices that
    cut across the caller's pieces and the tensors read anew), gives the bytes
    and the checksum verdict of one whole read, in Python and through the
    native call: a byte flipped in its last slice is found."""
    from chatkv.storage import chunkfile

    monkeypatch.setattr(chunkfile, "HASHED_READ_BYTES", slice_bytes)
    extra = {"kv": torch.randn(4, 33), "scale": torch.rand(50)}
    store.open_session("s")
    r = store.save_kv("s", token_ids=list(range(20)), fingerprint=FP, chunks=[NewChunk(20, extra, META)])
    dest = bytearray(4 * 33 * 4)
    (source,) = list(store.open_kv("s"))
    fresh = source.read_into({"kv": [memoryview(dest)[:100], memoryview(dest)[100:]]})
    assert torch.equal(torch.frombuffer(dest, dtype=torch.float32).view(4, 33), extra["kv"])
    assert set(fresh) == {"scale"} and torch.equal(fresh["scale"], extra["scale"])
    path = store.path_of(r.chunks[0])
    data = bytearray(path.read_bytes())
    at = data.find(extra["kv"].numpy().tobytes()) + 4 * 33 * 4 - 2  # in the KV's last bytes
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    (source,) = list(store.open_kv("s"))
    with pytest.raises(CorruptChunkError, match="checksum mismatch"):
        source.read_into({"kv": [bytearray(4 * 33 * 4)]})
    assert chunk_reads.native_calls == (2 if chunk_reads.path == "native" else 0)


def test_open_kv_checks_the_fingerprint_and_the_tokens(store: Store) -> None:
    ids = list(range(70))
    store.open_session("s")
    store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    with pytest.raises(FingerprintMismatchError):
        store.open_kv("s", fingerprint="another-model")
    # A session whose cached ids no longer match its chunk's tokens: the chunk is quarantined.
    store.open_session("t")
    r = store.save_kv("t", token_ids=ids[:64], fingerprint=FP, chunks=new_chunks(ids[:64]))
    kv = store.open_kv("t")
    kv.token_ids = [7] + ids[1:64]
    with pytest.raises(CorruptChunkError, match="tokens differ"):
        list(kv)
    assert not store.has_chunk(r.chunks[0].hash)


@pytest.mark.parametrize("where", ["first read", "header past it", "ids past it"])
def test_open_kv_reads_headers_and_token_ids_wherever_they_lie(store: Store, chunk_reads, where: str) -> None:
    """A chunk is opened with one read of its first bytes where its header and
    token ids lie in them, with more reads where they do not (a long header;
    token ids after a large tensor, as ``safetensors.torch.save`` laid out
    the chunks of earlier versions); either way the same tokens and tensors."""
    import json

    from safetensors.torch import load_file, save_file

    from chatkv.storage.chunkfile import OPEN_READ_BYTES, read_safetensors_metadata

    ids = list(range(40))
    extra = {"note": "x" * (2 * OPEN_READ_BYTES)} if where == "header past it" else {}
    tensors = {"kv": torch.randn(2, 2, 4, 2, 8)}
    if where == "ids past it":  # float32 and more than the first read
        tensors["big"] = torch.randn(2 * OPEN_READ_BYTES)
    info = store.write_chunk(ids, tensors, ChunkMeta(FP, "paged-v1", "float32", 16, "none", extra=extra))
    path = store.path_of(info)
    if where == "ids past it":  # rewritten as earlier versions wrote it: the float32 tensors before the int32 ids
        save_file(load_file(path), path, metadata=read_safetensors_metadata(path))
    with path.open("rb") as f:
        header_bytes = 8 + int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_bytes - 8))
    ids_end = header_bytes + header["__token_ids__"]["data_offsets"][1]
    assert (header_bytes > OPEN_READ_BYTES) == (where == "header past it")
    assert (ids_end > OPEN_READ_BYTES) == (where != "first read")
    assert read_safetensors_metadata(path).get("x.note") == extra.get("note")
    store.open_session("s")
    store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=[info.hash])
    (source,) = list(store.open_kv("s", fingerprint=FP))
    assert source.token_ids == ids
    got = torch.empty(2, 2, 4, 2, 8)
    fresh = source.read_into({"kv": [got.view(-1).view(torch.uint8).numpy().data]})
    assert torch.equal(got, tensors["kv"]) and set(fresh) == set(tensors) - {"kv"}
    for name, t in fresh.items():
        assert torch.equal(t, tensors[name])


def test_a_chunk_lays_out_its_token_ids_right_after_the_header(store: Store) -> None:
    """Whatever its tensors' dtypes (a compact chunk's float32 scales, which
    ``safetensors.torch.save`` put first), a chunk file holds its token ids
    right after the header, so that opening it reads both in one ``pread``
    and a cold read goes front to back; 8-byte tensors alone come before them
    (each tensor aligned to its item size). The file is still one that
    ``safetensors`` reads as written."""
    import json

    from safetensors.torch import load_file

    ids = list(range(40))
    tensors = {"k.scale": torch.randn(30, 3), "k.data": torch.randint(-128, 127, (30, 40, 8), dtype=torch.int8),
               "tail": torch.randn(2, 8).to(torch.bfloat16), "wide": torch.arange(3, dtype=torch.float64)}
    info = store.write_chunk(ids, tensors, ChunkMeta(FP, "paged-v1", "float32", 16, "int8"))
    path = store.path_of(info)
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    assert (8 + n) % 8 == 0
    spans = sorted((entry["data_offsets"], name) for name, entry in header.items() if name != "__metadata__")
    assert [name for _, name in spans] == ["wide", "__token_ids__", "k.scale", "tail", "k.data"]
    assert all(begin % tensors.get(name, torch.empty(0, dtype=torch.int32)).element_size() == 0
               for (begin, _), name in spans)
    loaded = load_file(path)
    assert loaded.pop("__token_ids__").tolist() == ids
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], t) for k, t in tensors.items())


@pytest.mark.parametrize("entry", [{"shape": [2, 2, 4, 2.0, 8]}, {"shape": [2, 2, 4, "2", 8]},
                                   {"data_offsets": [0.0, 1024]}, {"data_offsets": "0-1024"}])
def test_a_header_entry_of_other_than_whole_numbers_is_a_corrupt_chunk(store: Store, entry: dict) -> None:
    """A chunk whose header gives a tensor's shape or offsets as anything but
    JSON integers (a float, a string), its bytes otherwise intact, is
    refused when opened and quarantined, not read at offsets it made up."""
    import json

    ids = list(range(16))
    info = store.write_chunk(ids, {"kv": torch.randn(2, 2, 4, 2, 8)},
                             ChunkMeta(FP, "paged-v1", "float32", 16, "none"))
    path = store.path_of(info)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + n])
    header["kv"].update(entry)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(data[:8] + text.ljust(n) + data[8 + n:])  # (the same size: headers may end in spaces)
    store.open_session("s")
    store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=[info.hash])
    with pytest.raises(CorruptChunkError, match="not a readable safetensors file"):
        list(store.open_kv("s", fingerprint=FP))
    assert not store.has_chunk(info.hash)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_into_converts_scaled_codes_as_it_reads_them(store: Store, chunk_reads, dtype) -> None:
    """A chunk's int8 codes, converted as they are read into the caller's
    buffers (split mid-tensor), hold their codes times their row's scale,
    rounded once to the buffers' dtype; the scales come back read, the other
    tensors land as asked, and a flipped code is a checksum mismatch. Without
    the native reads, asking for a conversion is refused before anything is read."""
    from chatkv.storage import Converted

    codes = torch.randint(-127, 128, (6, 8), dtype=torch.int8)
    scale = torch.rand(6) / 100
    kv = torch.randn(3, 4)
    store.open_session("s")
    r = store.save_kv("s", token_ids=list(range(20)), fingerprint=FP,
                      chunks=[NewChunk(20, {"codes": codes, "scale": scale, "kv": kv}, META)])
    out = torch.full((6, 8), 5.0, dtype=dtype)
    rows = out.view(torch.uint8).numpy()
    converted = {"codes": Converted([rows[:2], rows[2:]], dtype, 8, "scale")}
    dest = bytearray(kv.numel() * 4)
    (source,) = list(store.open_kv("s"))
    if chunk_reads.path == "python":
        with pytest.raises(ValueError, match="need the native reads"):
            source.read_into({"kv": [dest]}, converted=converted)
        assert torch.equal(out, torch.full((6, 8), 5.0, dtype=dtype)) and dest == bytearray(len(dest))
        return
    fresh = source.read_into({"kv": [dest]}, converted=converted)
    assert set(fresh) == {"scale"} and torch.equal(fresh["scale"], scale)
    assert torch.equal(out, (codes.float() * scale[:, None]).to(dtype))
    assert torch.equal(torch.frombuffer(dest, dtype=torch.float32).view(3, 4), kv)
    for bad, match in ((Converted([rows], dtype, 8, "kv"), "holds 12 values, not the 6 that"),
                       (Converted([rows], dtype, 8, "nope"), "no float32 tensor 'nope'"),
                       (Converted([rows[:1]], dtype, 8, "scale"), "do not hold its 48 elements"),
                       (Converted([rows], torch.float16, 8, "scale"), "from int8 to float16")):
        (source,) = list(store.open_kv("s"))
        with pytest.raises(ValueError, match=match):
            source.read_into({}, converted={"codes": bad})
    path = store.path_of(r.chunks[0])
    data = bytearray(path.read_bytes())
    data[data.find(codes.numpy().tobytes()) + 40] ^= 0x01
    path.write_bytes(bytes(data))
    (source,) = list(store.open_kv("s"))
    with pytest.raises(CorruptChunkError, match="checksum mismatch"):
        source.read_into({}, converted=converted)
