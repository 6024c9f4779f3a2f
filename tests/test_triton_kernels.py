"""The Triton paged-attention kernels against the SDPA reference.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1),
so shapes stay small. With CUDA the same tests run on the GPU, and the tests
marked ``cuda`` add realistic shapes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Must happen before triton is imported: triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from chatkv.attention.base import AttentionMetadata  # noqa: E402
from chatkv.attention.torch_backend import paged_attention_reference  # noqa: E402
from chatkv.attention.triton_backend import TritonBackend  # noqa: E402
from chatkv.kernels import paged_decode, paged_prefill  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET is off", allow_module_level=True)

cuda = pytest.mark.cuda
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOL = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def make_case(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    block_size: int = 4,
    kv_heads: int = 2,
    group: int = 1,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 3,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A random paged cache holding ``seq_lens`` tokens per sequence, and a packed query.

    The caches are layer 1 of a two-layer pool ``[L, 2, NB, BS, Hkv, D]``, so
    they are not contiguous across layers (like the engine's); blocks are
    scattered in random order and the tables are 0-padded past each sequence.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq) + 2
    pool = torch.randn(  # [L, 2, NB, BS, Hkv, D]
        (2, 2, num_blocks, block_size, kv_heads, head_dim), generator=gen
    ).to(dtype)
    assert pool.shape == (2, 2, num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = pool[1, 0], pool[1, 1]
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)  # [S, max_blocks]
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = order[used : used + n]
        used += n
    total = sum(query_lens)
    query = torch.randn((total, kv_heads * group, head_dim), generator=gen).to(dtype)  # [T, Hq, D]
    assert query.shape == (total, kv_heads * group, head_dim)
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(
        kv=pool.to(DEVICE),
        slot_mapping=torch.zeros(total, dtype=torch.int64, device=DEVICE),  # unused by attention
        block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        seq_lens_list=list(seq_lens),
        query_lens_list=list(query_lens),
        max_query_len=max(query_lens),
    )
    return query.to(DEVICE), meta.kv[1, 0], meta.kv[1, 1], meta


def reference(query, k_cache, v_cache, meta, sliding_window=None):  # type: ignore[no-untyped-def]
    """The torch backend's answer, computed in float32 for a stable comparison."""
    return paged_attention_reference(
        query.float(), k_cache.float(), v_cache.float(), meta.block_tables,
        meta.seq_lens_list, meta.query_lens_list, query.shape[-1] ** -0.5, sliding_window,
    )


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err} > {TOL[dtype]}"


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize(
    "block_size,group,seq_lens",
    [
        (4, 1, [1, 5, 8, 19]),       # 19 ends mid-block; 8 exactly on a boundary
        (16, 3, [3, 17, 40]),
        (8, 4, [33, 2]),
    ],
)
def test_decode_matches_reference(block_size: int, group: int, seq_lens: list[int]) -> None:
    query, k, v, meta = make_case(seq_lens, [1] * len(seq_lens), block_size=block_size, group=group)
    out = paged_decode(query, k, v, meta.block_tables, meta.seq_lens, 16**-0.5, num_splits=1)
    assert_close(out, reference(query, k, v, meta), torch.float32)


@pytest.mark.parametrize("num_splits", [3, 8])
def test_decode_split_k(num_splits: int) -> None:
    # 8 splits of a 2-token context leave most splits empty: they must weigh nothing.
    query, k, v, meta = make_case([2, 45, 13], [1, 1, 1], block_size=4, group=2)
    out = paged_decode(
        query, k, v, meta.block_tables, meta.seq_lens, 16**-0.5, num_splits=num_splits
    )
    assert_close(out, reference(query, k, v, meta), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_sliding_window(num_splits: int) -> None:
    query, k, v, meta = make_case([3, 30, 47], [1, 1, 1], block_size=8, group=2)
    out = paged_decode(
        query, k, v, meta.block_tables, meta.seq_lens, 16**-0.5,
        sliding_window=10, num_splits=num_splits,
    )
    assert_close(out, reference(query, k, v, meta, sliding_window=10), torch.float32)


def test_decode_head_dim_not_power_of_two() -> None:
    query, k, v, meta = make_case([9, 14], [1, 1], block_size=4, group=2, head_dim=24)
    out = paged_decode(query, k, v, meta.block_tables, meta.seq_lens, 24**-0.5, num_splits=2)
    ref = paged_attention_reference(
        query, k, v, meta.block_tables, meta.seq_lens_list, meta.query_lens_list, 24**-0.5
    )
    assert_close(out, ref, torch.float32)


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize(
    "block_size,group,seq_lens,query_lens",
    [
        (4, 1, [7, 20, 3], [3, 9, 3]),      # chunks on a cached prefix; one fresh prefill
        (16, 3, [21, 5], [21, 2]),
        (8, 4, [30, 11, 6], [12, 1, 6]),    # a decode row mixed with prefill rows
    ],
)
def test_prefill_matches_reference(
    block_size: int, group: int, seq_lens: list[int], query_lens: list[int]
) -> None:
    query, k, v, meta = make_case(seq_lens, query_lens, block_size=block_size, group=group)
    out = paged_prefill(
        query, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
        meta.max_query_len, 16**-0.5,
    )
    assert_close(out, reference(query, k, v, meta), torch.float32)


def test_prefill_small_tiles_cross_many_blocks() -> None:
    # block_m / block_n smaller than the chunk: several query tiles, several key tiles.
    query, k, v, meta = make_case([37], [29], block_size=4, group=1)
    out = paged_prefill(
        query, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
        meta.max_query_len, 16**-0.5, block_m=16, block_n=16,
    )
    assert_close(out, reference(query, k, v, meta), torch.float32)


@pytest.mark.parametrize("window", [1, 6])
def test_prefill_sliding_window(window: int) -> None:
    query, k, v, meta = make_case([26, 9], [18, 9], block_size=4, group=2)
    out = paged_prefill(
        query, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
        meta.max_query_len, 16**-0.5, sliding_window=window, block_m=8,
    )
    assert_close(out, reference(query, k, v, meta, sliding_window=window), torch.float32)


# --------------------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype: torch.dtype) -> None:
    query, k, v, meta = make_case([6, 23], [1, 1], block_size=4, group=2, dtype=dtype)
    out = paged_decode(query, k, v, meta.block_tables, meta.seq_lens, 16**-0.5, num_splits=2)
    assert_close(out, reference(query, k, v, meta), dtype)

    query, k, v, meta = make_case([6, 23], [4, 10], block_size=4, group=2, dtype=dtype)
    out = paged_prefill(
        query, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
        meta.max_query_len, 16**-0.5,
    )
    assert_close(out, reference(query, k, v, meta), dtype)


# --------------------------------------------------------------------------- cache dtype


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_rejects_quantized_cache(cache_dtype: torch.dtype) -> None:
    # The pool is always full precision (quantized tiers dequantize on reload).
    query, k, v, meta = make_case([5], [1])
    kq, vq = k.to(cache_dtype), v.to(cache_dtype)
    with pytest.raises(AssertionError, match="cache dtype"):
        paged_decode(query, kq, vq, meta.block_tables, meta.seq_lens, 1.0)
    with pytest.raises(AssertionError, match="cache dtype"):
        paged_prefill(
            query, kq, vq, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
            meta.max_query_len, 1.0,
        )


# --------------------------------------------------------------------------- backend


def test_backend_dispatch() -> None:
    backend = TritonBackend(num_splits=2)
    assert backend.name == "triton" and TritonBackend.is_available(DEVICE)
    query, k, v, meta = make_case([4, 18], [1, 1], block_size=4, group=3)
    assert meta.is_decode_only
    assert_close(backend.forward(query, k, v, meta, 16**-0.5), reference(query, k, v, meta), torch.float32)

    query, k, v, meta = make_case([4, 18], [1, 7], block_size=4, group=3, seed=1)
    assert not meta.is_decode_only
    out = backend.forward(query, k, v, meta, 16**-0.5, sliding_window=5)
    assert_close(out, reference(query, k, v, meta, sliding_window=5), torch.float32)


@pytest.mark.parametrize("window", [None, 7])
def test_flex_backend_decode(window: int | None) -> None:
    flex = pytest.importorskip("chatkv.attention.flex_backend")
    if not flex.HAS_FLEX:
        pytest.skip("this torch has no FlexAttention")
    backend = flex.FlexBackend(compile=False)  # eager: this checks the block mask, not speed
    query, k, v, meta = make_case([1, 16, 21, 40], [1, 1, 1, 1], block_size=4, group=2)
    out = backend.forward(query, k, v, meta, 16**-0.5, sliding_window=window)
    assert_close(out, reference(query, k, v, meta, sliding_window=window), torch.float32)


@pytest.mark.parametrize("window", [None, 7])
def test_flex_block_mask_with_and_without_full_blocks(window: int | None) -> None:
    # The compiled path (CUDA) marks no block full. Eager FlexAttention applies the
    # mask function to every key, so the block lists are checked on their own: the
    # compiled kernel reads only the blocks they name.
    flex = pytest.importorskip("chatkv.attention.flex_backend")
    if not flex.HAS_FLEX:
        pytest.skip("this torch has no FlexAttention")
    query, k, v, meta = make_case([1, 16, 21, 40], [1, 1, 1, 1], block_size=4, group=2, seed=3)
    num_seqs, num_blocks, block_size = query.shape[0], k.shape[0], k.shape[1]
    want = reference(query, k, v, meta, sliding_window=window)
    for full in (True, False):
        mask = flex.build_decode_block_mask(meta.block_tables, meta.seq_lens, num_blocks, block_size, window,
                                            full_blocks=full)
        assert (mask.full_kv_num_blocks is not None) == (full and window is None)
        lists = [(mask.kv_num_blocks, mask.kv_indices), (mask.full_kv_num_blocks, mask.full_kv_indices)]
        for i, n in enumerate(meta.seq_lens_list):
            first = 0 if window is None else max(0, n - window) // block_size
            visible = meta.block_tables[i, first: -(-n // block_size)].tolist()
            listed = [b for num, idx in lists if num is not None for b in idx[i, 0, 0, : num[i, 0, 0]].tolist()]
            assert sorted(listed) == sorted(visible)  # each visible block once, nothing else
        out = flex.flex_attention(
            query.unsqueeze(2), flex._pool_as_sequence(k, num_seqs), flex._pool_as_sequence(v, num_seqs),
            block_mask=mask, scale=16**-0.5, enable_gqa=True,
        ).squeeze(2)
        assert_close(out, want, torch.float32)


def test_imports_without_triton() -> None:
    # A fresh interpreter where `import triton` fails: the modules import, the backend says no.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from chatkv.kernels import HAS_TRITON, paged_decode\n"
        "from chatkv.attention.triton_backend import TritonBackend\n"
        "assert not HAS_TRITON and not TritonBackend.is_available()\n"
        "try:\n    paged_decode(*[None] * 6)\nexcept RuntimeError as e:\n    print('ok', e)\n"
        "assert 'sqlalchemy' not in sys.modules\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


# --------------------------------------------------------------------------- CUDA, real shapes


@cuda
@requires_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_cuda_decode_llama_shape(num_splits: int | None) -> None:
    seq_lens = [1, 15, 16, 17, 1000, 4099]
    query, k, v, meta = make_case(
        seq_lens, [1] * len(seq_lens), block_size=16, kv_heads=8, group=4, head_dim=128,
        dtype=torch.bfloat16,
    )
    out = paged_decode(
        query, k, v, meta.block_tables, meta.seq_lens, 128**-0.5, num_splits=num_splits,
        max_seq_len=max(seq_lens),
    )
    assert_close(out, reference(query, k, v, meta), torch.bfloat16)


@cuda
@requires_cuda
@pytest.mark.parametrize("block_size", [16, 64])
def test_cuda_prefill_llama_shape(block_size: int) -> None:
    query, k, v, meta = make_case(
        [700, 300, 129], [200, 300, 1], block_size=block_size, kv_heads=8, group=4,
        head_dim=128, dtype=torch.bfloat16,
    )
    out = paged_prefill(
        query, k, v, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
        meta.max_query_len, 128**-0.5, sliding_window=256,
    )
    assert_close(out, reference(query, k, v, meta, sliding_window=256), torch.bfloat16)


@cuda
@requires_cuda
def test_cuda_flex_backend_compiled_llama_shape() -> None:
    # Compiled FlexAttention over the pool, several contexts and batch sizes in one
    # process; on torch 2.11 its full-block path gave errors of 0.1 to 0.35 here.
    flex = pytest.importorskip("chatkv.attention.flex_backend")
    if not flex.HAS_FLEX:
        pytest.skip("this torch has no FlexAttention")
    backend = flex.FlexBackend()  # compiled on CUDA
    for seed, seq_lens in enumerate([[1024], [2048], [1024] * 4, [17, 1000, 4099, 16]]):
        query, k, v, meta = make_case(
            seq_lens, [1] * len(seq_lens), block_size=16, kv_heads=8, group=4, head_dim=128,
            dtype=torch.bfloat16, spare_blocks=40, seed=seed,
        )
        assert_close(backend.forward(query, k, v, meta, 128**-0.5), reference(query, k, v, meta), torch.bfloat16)
