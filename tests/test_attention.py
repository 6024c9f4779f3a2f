"""Paged attention and the packed runner against transformers' own attention."""

from __future__ import annotations

import math

import pytest
import torch

from chatkv.attention import TorchBackend
from chatkv.attention import torch_backend
from chatkv.attention.torch_backend import paged_attention_reference, product_attention
from chatkv.block_pool import BlockPool
from chatkv.runner import ModelRunner, StepInput
from chatkv.sequence import Sequence
from chatkv.testing import tiny_model

from conftest import stock_copy


def dense_attention(q, k, v, scale, window=None):
    """Naive causal attention for one sequence, queries at the last positions.
    q [Tq, Hq, D], k/v [Tk, Hkv, D]."""
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    rep = hq // hkv
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(tk - tq, tk)[:, None]
    kpos = torch.arange(tk)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_dense_attention_for_ragged_batch(block_size, window):
    torch.manual_seed(0)
    hq, hkv, d = 6, 2, 8
    # Short prefills attend grouped (GROUPED_QUERY_MAX), the 40-token one as SDPA's GQA.
    seq_lens, query_lens = [7, 13, 1, 20, 45, 26], [7, 1, 1, 5, 40, 5]
    num_blocks = 128
    k_cache = torch.randn(num_blocks, block_size, hkv, d)
    v_cache = torch.randn(num_blocks, block_size, hkv, d)
    perm = torch.randperm(num_blocks).tolist()  # blocks scattered through the pool
    tables, used = [], 0
    for n in seq_lens:
        nb = -(-n // block_size)
        tables.append(perm[used : used + nb])
        used += nb
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(query_lens), hq, d)
    out = paged_attention_reference(q, k_cache, v_cache, table, seq_lens, query_lens, d ** -0.5, window,
                                    masks={})  # the masks shared between sequences as between layers
    start = 0
    for i, (n, ql) in enumerate(zip(seq_lens, query_lens)):
        k = k_cache[tables[i]].reshape(-1, hkv, d)[:n]
        v = v_cache[tables[i]].reshape(-1, hkv, d)[:n]
        want = dense_attention(q[start : start + ql], k, v, d ** -0.5, window)
        torch.testing.assert_close(out[start : start + ql], want, atol=1e-5, rtol=1e-5)
        start += ql


def _runner(arch: str, num_blocks: int = 128, block_size: int = 4):
    model, _ = tiny_model(arch)
    reference = stock_copy(model)
    cfg = model.config
    pool = BlockPool(num_blocks, block_size, cfg.num_hidden_layers, cfg.num_key_value_heads,
                     cfg.head_dim, torch.float32, "cpu", "test")
    return ModelRunner(model, pool, TorchBackend()), reference, pool


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_chunked_prefill_and_decode_match_stock_model(arch):
    """Prefill in uneven chunks on top of cached blocks, then decode: every logit
    equals transformers' own forward over the whole sequence (sliding windows
    included: the tiny Mistral/Qwen use a 24-token window, and this runs 60 tokens)."""
    runner, reference, pool = _runner(arch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (60,), generator=g).tolist()
    with torch.no_grad():
        full = reference(torch.tensor([ids])).logits[0]
    seq = Sequence(token_ids=list(ids))
    got = []
    for lo, hi in [(0, 23), (23, 24), (24, 50)] + [(i, i + 1) for i in range(50, 60)]:
        got.append((hi - 1, runner.forward([StepInput(seq, ids[lo:hi])])[0]))
    for pos, logits in got:
        torch.testing.assert_close(logits, full[pos], atol=1e-4, rtol=1e-4)
    pool.release(seq)
    assert pool.stats().used_blocks == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_packed_batch_equals_one_at_a_time(arch):
    """One sequence prefilling and one decoding, packed in a single forward,
    give the same logits as running each alone."""
    runner, _, pool = _runner(arch)
    g = torch.Generator().manual_seed(2)
    a_ids = torch.randint(0, 300, (30,), generator=g).tolist()
    b_ids = torch.randint(0, 300, (41,), generator=g).tolist()

    def setup():
        a, b = Sequence(token_ids=list(a_ids)), Sequence(token_ids=list(b_ids))
        runner.forward([StepInput(a, a_ids[:12])])
        runner.forward([StepInput(b, b_ids[:40])])
        return a, b

    a, b = setup()
    packed = runner.forward([StepInput(a, a_ids[12:]), StepInput(b, b_ids[40:])])
    pool.release(a)
    pool.release(b)
    a, b = setup()
    alone_a = runner.forward([StepInput(a, a_ids[12:])])[0]
    alone_b = runner.forward([StepInput(b, b_ids[40:])])[0]
    torch.testing.assert_close(packed[0], alone_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[1], alone_b, atol=1e-5, rtol=1e-5)
    pool.release(a)
    pool.release(b)
    assert pool.num_available == pool.num_blocks


def test_kv_is_written_in_place_without_reallocating_the_pool():
    runner, _, pool = _runner("llama")
    ptr = pool.kv.data_ptr()
    seq = Sequence(token_ids=list(range(1, 11)))
    runner.forward([StepInput(seq, seq.token_ids[:10])])
    assert pool.kv.data_ptr() == ptr
    assert pool.kv[:, :, seq.block_table[0]].abs().sum() > 0


def test_attention_without_metadata_fails_clearly():
    runner, _, _ = _runner("llama")
    with pytest.raises(RuntimeError, match="chatkv_meta"):
        runner.model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_through_the_triton_backend_matches_stock(arch):
    """The fused kernels (in Triton's interpreter on the CPU) driven by a real
    model forward: chunked prefill then decode equal transformers' logits."""
    pytest.importorskip("triton")
    from chatkv.attention.triton_backend import TritonBackend

    if not TritonBackend.is_available(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("triton cannot run here (no CUDA, interpreter off)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: in the interpreter
    model, _ = tiny_model(arch)
    reference = stock_copy(model).to(device)
    model.to(device)
    cfg = model.config
    pool = BlockPool(32, 8, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                     torch.float32, device, "test")
    runner = ModelRunner(model, pool, TritonBackend())
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        full = reference(torch.tensor([ids], device=device)).logits[0]
    seq = Sequence(token_ids=list(ids))
    for lo, hi in [(0, 29), (29, 37), (37, 38), (38, 39), (39, 40)]:
        logits = runner.forward([StepInput(seq, ids[lo:hi])])[0]
        torch.testing.assert_close(logits, full[hi - 1], atol=1e-4, rtol=1e-4)
    pool.release(seq)


def test_consecutive_blocks_read_as_a_view_give_the_same_attention():
    torch.manual_seed(3)
    k_cache = torch.randn(32, 4, 2, 8)
    v_cache = torch.randn(32, 4, 2, 8)
    table = torch.tensor([[5, 6, 7, 8, 9]], dtype=torch.int32)
    q = torch.randn(3, 4, 8)
    gathered = paged_attention_reference(q, k_cache, v_cache, table, [18], [3], 8 ** -0.5)
    viewed = paged_attention_reference(q, k_cache, v_cache, table, [18], [3], 8 ** -0.5, contiguous_start=[5])
    torch.testing.assert_close(viewed, gathered, atol=0, rtol=0)


def _eager(q, k, v, scale, window):
    """transformers' eager attention (the llama module's) for one sequence whose
    queries are the last positions: q [Hq, T, D], k/v [Hkv, L, D] -> [Hq, T, D]."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    hq, t, _ = q.shape
    hkv, n, _ = k.shape
    qpos = torch.arange(n - t, n)[:, None]
    kpos = torch.arange(n)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    mask = torch.zeros(t, n, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = hq // hkv, False
    out, _ = eager_attention_forward(module, q[None], k[None], v[None], mask[None, None], scaling=scale)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("head_dim", [64, 48])  # a power-of-two scale, and one that is not
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("max_scores", [1 << 23, 3000])  # one product, and rows cut into chunks
@pytest.mark.parametrize("t", [5, 21])  # scores as k @ q^T (15 rows a KV head), and as q @ k^T (63)
@pytest.mark.parametrize("layout", ["heads", "pool rows"])  # [kv_heads, L, D] of their own, or the pool's view
@pytest.mark.parametrize("softmax_tile", [1 << 19, 1000])  # one softmax per chunk, or a few rows at a time
def test_products_equal_transformers_eager_attention_bit_for_bit(head_dim, window, max_scores, t, layout,
                                                                  softmax_tile, monkeypatch):
    monkeypatch.setattr(torch_backend, "PRODUCTS_MAX_SCORES", max_scores)
    monkeypatch.setattr(torch_backend, "SOFTMAX_TILE_SCORES", softmax_tile)
    torch.manual_seed(4)
    kv_heads, group, n = 3, 3, 300
    q = torch.randn(kv_heads * group, t, head_dim, dtype=torch.bfloat16)
    if layout == "heads":
        k = torch.randn(kv_heads, n, head_dim, dtype=torch.bfloat16)
        v = torch.randn(kv_heads, n, head_dim, dtype=torch.bfloat16)
    else:  # as the engine hands them over: [L, kv_heads, D] rows read per head
        k = torch.randn(n, kv_heads, head_dim, dtype=torch.bfloat16).transpose(0, 1)
        v = torch.randn(n, kv_heads, head_dim, dtype=torch.bfloat16).transpose(0, 1)
    assert (group * t > torch_backend.KEYS_FIRST_MAX_ROWS) == (t == 21)
    scale = head_dim ** -0.5
    got = product_attention(q.view(kv_heads, group, t, head_dim), k, v, scale, window)
    got = got.reshape(kv_heads * group, t, head_dim)
    want = _eager(q, k.contiguous(), v.contiguous(), scale, window)
    if window is None and max_scores > kv_heads * group * t * n:
        assert torch.equal(got, want)  # the same products over the same keys
    else:  # keys no row of a chunk sees are skipped: the same terms summed in a new order
        torch.testing.assert_close(got, want, atol=1e-5, rtol=2 ** -8)


@pytest.mark.parametrize("tails", ["finite", "not finite"])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_decode_rows_by_products_equal_transformers_eager_attention_bit_for_bit(head_dim, tails, monkeypatch):
    """A decode step's rows take the products' path of their own (one product
    over every KV head, the queries laid out block diagonally, where the keys
    are rows of the pool, over whole blocks): each equals transformers' eager
    attention bit for bit, in a packed step of several sequences and called
    alone, whatever the unwritten slots of a sequence's last block hold."""
    monkeypatch.setattr(torch_backend, "PRODUCTS_FROM_POSITION", 0)
    torch.manual_seed(8)
    kv_heads, group, bs = 3, 3, 16
    lens = [1, 300, 47, 1000]
    blocks = [-(-n // bs) for n in lens]
    k_cache = torch.randn(sum(blocks) + 2, bs, kv_heads, head_dim, dtype=torch.bfloat16) * 3
    v_cache = torch.randn(sum(blocks) + 2, bs, kv_heads, head_dim, dtype=torch.bfloat16)
    order = torch.randperm(sum(blocks) + 2)[: sum(blocks)].to(torch.int32)  # scattered blocks
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for i, first in enumerate(torch.tensor([0] + blocks).cumsum(0)[:-1].tolist()):
        table[i, : blocks[i]] = order[first : first + blocks[i]]
    if tails == "not finite":  # slots past each sequence's length in its last block
        for i, n in enumerate(lens):
            if n % bs:
                k_cache[table[i, blocks[i] - 1], n % bs :] = float("nan")
                v_cache[table[i, blocks[i] - 1], n % bs :] = float("inf")
    # [T, heads, D] as the engine hands it over: a transposed view of [heads, T, D].
    q = torch.randn(kv_heads * group, len(lens), head_dim, dtype=torch.bfloat16).transpose(0, 1)
    scale = head_dim ** -0.5
    packed = paged_attention_reference(q, k_cache, v_cache, table, lens, [1] * len(lens), scale,
                                       products=True, masks={})
    for i, n in enumerate(lens):
        k = torch_backend.gather_sequence_kv(k_cache, table[i], n).transpose(0, 1)
        v = torch_backend.gather_sequence_kv(v_cache, table[i], n).transpose(0, 1)
        want = _eager(q[i].unsqueeze(1), k.contiguous(), v.contiguous(), scale, None)[:, 0]  # [heads, D]
        assert torch.equal(packed[i], want), (i, n)
        alone = product_attention(q[i].reshape(kv_heads, group, 1, head_dim), k.contiguous(), v.contiguous(),
                                  scale, None)  # [kv_heads, L, D] tensors of their own: per-head products
        assert torch.equal(alone.reshape(kv_heads * group, head_dim), want), (i, n)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("max_scores", [1 << 23, 2000])
def test_a_rows_products_do_not_depend_on_the_step_that_computes_it(window, max_scores, monkeypatch):
    """One prefill of 70 tokens, or prefills of 40, 9 and 3 then 18 decode steps,
    over the same keys and values: every row's output is the same bit for bit
    (so a resumed session's KV is the KV a fresh re-prefill computes). Rows
    before position 30 attend through SDPA, the rest by products; steps
    straddle that position."""
    monkeypatch.setattr(torch_backend, "PRODUCTS_MAX_SCORES", max_scores)
    monkeypatch.setattr(torch_backend, "PRODUCTS_FROM_POSITION", 30)
    torch.manual_seed(6)
    hq, hkv, d, bs, n = 6, 2, 64, 16, 70
    k_cache = torch.randn(8, bs, hkv, d, dtype=torch.bfloat16)
    v_cache = torch.randn(8, bs, hkv, d, dtype=torch.bfloat16)
    table = torch.tensor([[3, 1, 6, 0, 2]], dtype=torch.int32)  # scattered blocks
    q = torch.randn(n, hq, d, dtype=torch.bfloat16)
    whole = paged_attention_reference(q, k_cache, v_cache, table, [n], [n], d ** -0.5, window, products=True)
    steps = [(0, 40), (40, 49), (49, 52)] + [(i, i + 1) for i in range(52, n)]
    parts = [paged_attention_reference(q[lo:hi], k_cache, v_cache, table, [hi], [hi - lo], d ** -0.5, window,
                                       products=True) for lo, hi in steps]
    assert torch.equal(torch.cat(parts), whole)
    early = paged_attention_reference(q[:30], k_cache, v_cache, table, [30], [30], d ** -0.5, window)
    assert torch.equal(whole[:30], early)  # SDPA's rows, as SDPA alone computes them
    sdpa = paged_attention_reference(q, k_cache, v_cache, table, [n], [n], d ** -0.5, window)
    assert not torch.equal(whole[30:], sdpa[30:])
    torch.testing.assert_close(whole, sdpa, atol=2e-2, rtol=2e-2)  # bf16 scores against float32 ones
    assert torch_backend.products_apply(q) and not torch_backend.products_apply(q.float())


@pytest.mark.parametrize("max_scores", [1 << 23, 2000])  # one product per layer, and rows cut into chunks
@pytest.mark.parametrize("head_dim", [64, 48])  # the queries scaled as they are copied, and after the product
def test_a_steps_layers_share_scratch_buffers_without_mixing_their_values(head_dim, max_scores, monkeypatch):
    """The layers of one step (one ``masks`` dict) compute their products in
    the same scratch memory, one after another, with sequences of two shapes
    in the step: each layer's rows are exactly what the same call computes
    with buffers of its own (``masks=None``), whatever the layer before left
    there. The softmax goes a few rows at a time through float32 scratch too."""
    monkeypatch.setattr(torch_backend, "PRODUCTS_MAX_SCORES", max_scores)
    monkeypatch.setattr(torch_backend, "SOFTMAX_TILE_SCORES", 300)
    monkeypatch.setattr(torch_backend, "PRODUCTS_FROM_POSITION", 30)
    torch.manual_seed(9)
    layers, kv_heads, group, bs = 3, 2, 3, 16
    caches = torch.randn(layers, 2, 12, bs, kv_heads, head_dim, dtype=torch.bfloat16)
    table = torch.tensor([[3, 1, 6, 0, 2], [7, 8, 9, 10, 11]], dtype=torch.int32)
    lens, new = [70, 50], [25, 12]  # a step of two sequences: new rows straddle position 30 in the first
    queries = [torch.randn(sum(new), kv_heads * group, head_dim, dtype=torch.bfloat16) * 4 for _ in range(layers)]
    step: dict = {}
    scale = head_dim ** -0.5
    for layer in range(layers):
        k_cache, v_cache = caches[layer, 0], caches[layer, 1]
        shared = paged_attention_reference(queries[layer], k_cache, v_cache, table, lens, new, scale,
                                           masks=step, products=True)
        alone = paged_attention_reference(queries[layer], k_cache, v_cache, table, lens, new, scale,
                                          products=True)
        assert torch.equal(shared, alone), layer
    shared = {key[1] for key in step if isinstance(key, tuple) and key[0] == "scratch"}
    # The buffers were shared (chunks of few rows compute their scores keys first, in memory of their own).
    assert shared == ({"queries", "scores", "softmax"} if max_scores == 1 << 23 else {"queries"})


@pytest.mark.parametrize("shape", [(3, 40, 257), (700, 9), (1, 5, 4000)])
def test_a_softmax_a_few_rows_at_a_time_equals_one_softmax_bit_for_bit(shape, monkeypatch):
    """Scores of more than a tile (:data:`SOFTMAX_TILE_SCORES`) get their
    float32 softmax a tile of rows at a time, in place, through scratch: the
    same bfloat16 values as one softmax of them all, rounded back (tiles of
    3 rows of 257, of 111 rows of 9, and of one row wider than the tile);
    fewer scores, or scores not contiguous, get the one softmax."""
    monkeypatch.setattr(torch_backend, "SOFTMAX_TILE_SCORES", 1000)
    torch.manual_seed(12)
    scores = (torch.randn(shape) * 8).to(torch.bfloat16)
    scores[..., 0, :3] = float("-inf")  # masked keys
    want = torch.softmax(scores, -1, dtype=torch.float32).to(torch.bfloat16)
    work, masks = scores.clone(), {}
    got = torch_backend._softmax_rounded(work, masks)
    assert got.data_ptr() == work.data_ptr() and torch.equal(got, want)
    assert any(isinstance(key, tuple) and key[1] == "softmax" for key in masks)
    small = (torch.randn(10, 50) * 8).to(torch.bfloat16)  # 500 scores: left as they are
    kept = small.clone()
    assert torch.equal(torch_backend._softmax_rounded(small, {}),
                       torch.softmax(kept, -1, dtype=torch.float32).to(torch.bfloat16))
    assert torch.equal(small, kept)
    transposed = scores.transpose(-1, -2).contiguous().transpose(-1, -2)  # the keys-first products' scores
    assert torch.equal(torch_backend._softmax_rounded(transposed, {}), want)


@pytest.mark.parametrize("layout", ["consecutive", "scattered"])
@pytest.mark.parametrize("tails", ["finite", "not finite"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_a_decode_rows_shortcut_writes_and_attends_as_the_general_path_bit_for_bit(head_dim, window, dtype, tails,
                                                                                    layout, monkeypatch):
    """A one-row decode step takes the backend's shortcut (``decode_one``):
    the pool it leaves and the row it returns are the general path's
    (write_kv, then forward) bit for bit, through SDPA before
    PRODUCTS_FROM_POSITION and by products from there, at lengths on and off
    block boundaries, over blocks consecutive in the pool or not, whatever
    the unwritten slots after the row in its last block hold; it declines
    windowed products and steps of several rows."""
    from chatkv.attention import _attend
    from chatkv.attention.base import AttentionMetadata

    monkeypatch.setattr(torch_backend, "PRODUCTS_FROM_POSITION", 100)
    torch.manual_seed(11)
    layers, kv_heads, group, bs, first = 2, 3, 3, 16, 5
    pool = torch.randn(layers, 2, 40, bs, kv_heads, head_dim, dtype=dtype)
    pool[:, :, first + 12:] = float("nan")  # slots no token was written to: never read as values
    backend = TorchBackend(products=True)

    order = list(range(first, first + 12))
    if layout == "scattered":  # blocks in another order, read through the table
        order = order[::-1]

    def meta(n: int, kv: torch.Tensor, run: int) -> AttentionMetadata:
        blocks = -(-n // bs)
        table = torch.tensor(order[:blocks], dtype=torch.int32)[None]
        if layout == "scattered":
            run = -1
        slot = order[(n - 1) // bs] * bs + (n - 1) % bs
        return AttentionMetadata(kv=kv, slot_mapping=torch.tensor([slot]), block_tables=table,
                                 seq_lens=torch.tensor([n], dtype=torch.int32),
                                 cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), seq_lens_list=[n],
                                 query_lens_list=[1], max_query_len=1, backend=backend,
                                 extras={"contiguous_start": [run]})

    for n in [1, 16, 17, 99, 100, 101, 160, 177]:  # SDPA up to position 99, products from 100
        q = torch.randn(1, kv_heads * group, 1, head_dim, dtype=dtype)
        k = torch.randn(1, kv_heads, 1, head_dim, dtype=dtype)
        v = torch.randn(1, kv_heads, 1, head_dim, dtype=dtype)
        scale = head_dim ** -0.5
        tail = pool[1, 1, order[n // bs], n % bs:]  # the slots after the row in its last block
        kept = tail.clone()
        if tails == "not finite" and n % bs:  # one layer's is enough to keep every layer off them
            tail.fill_(float("inf"))
        for layer in range(layers):
            fast_pool, slow_pool = pool.clone(), pool.clone()
            m = meta(n, fast_pool, first)
            shortcut = (window is None or n - 1 < 100 or dtype is torch.float32)
            got = backend.decode_one(m, layer, q, k, v, scale, window)
            assert (got is not None) == shortcut, n
            if got is None:
                assert torch.equal(fast_pool.nan_to_num(), pool.nan_to_num())  # nothing written
                got = _attend(m, layer, q, k, v, scale, window)
            general = meta(n, slow_pool, first)
            general.max_query_len = 2  # not a decode row to _attend: the general path
            want = _attend(general, layer, q, k, v, scale, window)
            assert torch.equal(got, want), (n, layer)
            assert torch.equal(fast_pool.nan_to_num(), slow_pool.nan_to_num()), (n, layer)
        pool = fast_pool
        pool[1, 1, order[n // bs], n % bs:] = kept  # later rows see them as keys
    q = torch.randn(1, kv_heads * group, 1, head_dim, dtype=dtype)
    k = v = torch.randn(1, kv_heads, 1, head_dim, dtype=dtype)
    two = torch.randn(1, kv_heads * group, 2, head_dim, dtype=dtype)
    assert backend.decode_one(meta(20, pool, first), 0, two, k, v, 0.125, None) is None  # two rows


def test_engine_setting_and_environment_choose_the_cpu_attention(monkeypatch):
    from chatkv.attention import get_backend
    from chatkv.config import EngineConfig
    from chatkv.errors import ConfigError

    cpu = torch.device("cpu")
    monkeypatch.delenv(torch_backend.CPU_ATTENTION_ENV, raising=False)
    assert torch_backend.resolve_cpu_attention(None) == "auto"
    assert get_backend("auto", cpu, "auto").products and not get_backend("torch", cpu, "sdpa").products
    monkeypatch.setenv(torch_backend.CPU_ATTENTION_ENV, "SDPA")
    assert torch_backend.resolve_cpu_attention(None) == "sdpa"
    assert torch_backend.resolve_cpu_attention("auto") == "auto"  # the setting wins over the variable
    monkeypatch.setenv(torch_backend.CPU_ATTENTION_ENV, "fast")
    with pytest.raises(ConfigError, match="CHATKV_CPU_ATTENTION"):
        torch_backend.resolve_cpu_attention(None)
    with pytest.raises(ConfigError, match="cpu_attention"):
        EngineConfig(cpu_attention="flash")
