"""Fused paged-attention kernels in Triton, and the Python launchers that call them.

Both kernels read keys and values straight from the block pool through the
block tables; nothing is gathered into a contiguous copy first.

* :func:`paged_decode` -- one query token per sequence. A program owns one
  (sequence, KV head, context split): it loads the whole query-head group that
  shares the KV head, so each K/V byte is read once per step whatever the GQA
  ratio. Long contexts are cut into ``num_splits`` parts that run in parallel
  and write a partial output plus its log-sum-exp; a second small kernel merges
  them (split-K / "flash-decoding").
* :func:`paged_prefill` -- a chunk of new tokens per sequence attending to its
  cached prefix plus itself, causally. A program owns (query tile, sequence,
  KV head); its rows are ``BLOCK_M`` tokens x the head group, so again K/V is
  read once per KV head.

Both read full-precision caches only (float32, float16 or bfloat16): chatkv's
quantized tiers dequantize a session into the pool when it is reloaded, so the
pool never holds quantized blocks.

Triton is optional: without it this module still imports, ``HAS_TRITON`` is
False and the launchers raise.
"""

import os
from functools import lru_cache

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the module must import on machines without Triton
    HAS_TRITON = False

    class _JitStandIn:
        """Lets the kernel definitions below parse when Triton is absent; never launched."""

        constexpr = object

        @staticmethod
        def jit(fn=None, **_kwargs):  # type: ignore[no-untyped-def]
            return fn if fn is not None else (lambda f: f)

    triton = _JitStandIn()  # type: ignore[assignment]
    tl = _JitStandIn()  # type: ignore[assignment]


CACHE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
"""Cache dtypes the kernels read."""

_LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# --------------------------------------------------------------------------- kernels


@triton.jit
def _qk_dot(q, k, UPCAST: tl.constexpr):
    # q [R, D] (query dtype), k [N, D] (cache dtype) -> scores [R, N] float32.
    if UPCAST:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(q, tl.trans(k.to(q.dtype)))


@triton.jit
def _pv_dot(p, v, q, UPCAST: tl.constexpr):
    # p [R, N] float32 probabilities, v [N, D] (cache dtype) -> [R, D] float32;
    # the operands take the query's dtype.
    if UPCAST:
        return tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(p.to(q.dtype), v.to(q.dtype))


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    sm_scale_log2, window, num_splits,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_table,
    stride_ot, stride_oh,
    stride_ps, stride_ph, stride_pk,
    stride_ls, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    start = 0
    if USE_WINDOW:
        # The query sits at seq_len - 1 and sees keys at positions > seq_len - 1 - window.
        start = tl.maximum(seq_len - window, 0)
    # Even split of this sequence's visible span, in whole BLOCK_N tiles.
    per_split = tl.cdiv(tl.cdiv(seq_len - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite floor: see _prefill_kernel
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = tables_ptr + seq * stride_table
    for tile_start in range(lo, hi, BLOCK_N):
        tokens = tile_start + offs_n
        valid = tokens < hi
        block = tl.load(table_row + tokens // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        slot = tokens % PAGE_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_kt
            + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        scores = _qk_dot(q, k, UPCAST) * sm_scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt
            + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        acc = acc * alpha[:, None] + _pv_dot(p, v, q, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # An empty split (lo >= hi) leaves l_i = 0, so its lse is -inf and it weighs nothing.
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(
            part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + split * stride_pk
            + offs_d[None, :],
            out, mask=out_mask,
        )
        tl.store(part_lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=g_mask)
    else:
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=out_mask,
        )


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_ps, stride_ph, stride_pk,
    stride_ls, stride_lh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(
        part_lse_ptr + seq * stride_ls + head * stride_lh + offs_s, mask=s_mask, other=float("-inf")
    )
    # Split 0 is never empty, so the max is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(
        part_out_ptr + seq * stride_ps + head * stride_ph + offs_s[:, None] * stride_pk
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty), mask=d_mask,
    )


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, cu_q_ptr, out_ptr,
    sm_scale_log2, window,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_table,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # absolute position of this sequence's first new token

    # Row r of the tile is token tile*BLOCK_M + r // BLOCK_G of query head kv_head*GROUP + r % BLOCK_G.
    rows = tl.arange(0, BLOCK_M * BLOCK_G)
    tok = tile * BLOCK_M + rows // BLOCK_G
    grp = rows % BLOCK_G
    row_mask = (tok < q_len) & (grp < GROUP)
    q_pos = first_pos + tok
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    q_rows = q_ptr + (q_start + tok)[:, None] * stride_qt + (kv_head * GROUP + grp)[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    # Keys this tile can see: up to its last query (causal), from its first query's window.
    hi = tl.minimum(seq_len, first_pos + (tile + 1) * BLOCK_M)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos + tile * BLOCK_M - window + 1, 0)

    # The running max starts at a finite floor, not -inf: a row whose keys are all
    # masked in one tile then gets exp2(-inf - floor) = 0, not exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M * BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    table_row = tables_ptr + seq * stride_table
    for tile_start in range(lo, hi, BLOCK_N):
        tokens = tile_start + offs_n
        valid = tokens < hi
        block = tl.load(table_row + tokens // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        slot = tokens % PAGE_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_kt
            + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        scores = _qk_dot(q, k, UPCAST) * sm_scale_log2
        visible = valid[None, :] & (tokens[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (tokens[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt
            + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        acc = acc * alpha[:, None] + _pv_dot(p, v, q, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_rows = out_ptr + (q_start + tok)[:, None] * stride_ot + (kv_head * GROUP + grp)[:, None] * stride_oh
    tl.store(
        out_rows + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


# --------------------------------------------------------------------------- launchers


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("chatkv's fused paged attention needs Triton (pip install 'chatkv[triton]')")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """How many parts to split each decode context into, so the GPU has enough programs.

    One program per (sequence, KV head) leaves most SMs idle for small batches
    at long context; this aims at about four programs per SM, never cutting a
    part below 256 tokens and never above 64 parts. Always 1 off CUDA.
    """
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    programs = max(1, num_seqs * kv_heads)
    wanted = -(-4 * _sm_count(index) // programs)
    useful = -(-max_seq_len // 256)
    return max(1, min(wanted, useful, 64))


def _check_cache(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> tuple[int, int, int]:
    """Validate shapes and dtypes; return (group, page_size, head_dim)."""
    _, q_heads, head_dim = query.shape
    _, page_size, kv_heads, kv_dim = k_cache.shape
    assert v_cache.shape == k_cache.shape, (v_cache.shape, k_cache.shape)
    assert kv_dim == head_dim and q_heads % kv_heads == 0, (query.shape, k_cache.shape)
    assert page_size & (page_size - 1) == 0, f"block size must be a power of two, got {page_size}"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous"
    assert v_cache.dtype == k_cache.dtype, (k_cache.dtype, v_cache.dtype)
    assert k_cache.dtype in CACHE_DTYPES, f"cache dtype must be one of {CACHE_DTYPES}, got {k_cache.dtype}"
    return q_heads // kv_heads, page_size, head_dim


def _upcast(query: torch.Tensor) -> bool:
    # fp32 queries use IEEE fp32 dots (not tf32). The interpreter's tl.dot multiplies
    # bf16 bit patterns (triton-lang/triton#11584), so it gets fp32 operands there too.
    return query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and interpreting())


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: one new query token per sequence over its paged context.

    Args:
        query: ``[S, q_heads, head_dim]``; row ``i`` is sequence ``i``'s token at
            position ``seq_lens[i] - 1``.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``, the
            last dimension contiguous, block size a power of two; float16,
            bfloat16 or float32 (both the same dtype).
        block_tables: ``[S, max_blocks]`` int32.
        seq_lens: ``[S]`` int32, context length including the new token (>= 1).
        scale: softmax scale.
        sliding_window: a query at ``p`` sees keys at positions ``> p - sliding_window``.
        max_seq_len: ``max(seq_lens)`` as a Python int, to choose the split
            count without a device sync; read from ``seq_lens`` when omitted.
        num_splits: parts each context is cut into (>= 1); chosen from the
            batch shape and SM count when None. Above 1, a reduction kernel
            merges the partial results.
        block_n: keys per inner-loop tile (power of two >= 16); default 64 (16 under the interpreter).
        out: optional ``[S, q_heads, head_dim]`` output buffer.

    Returns:
        ``[S, q_heads, head_dim]`` in the query's dtype (or ``out``).
    """
    _require_triton()
    num_seqs, q_heads, head_dim = query.shape
    group, page_size, _ = _check_cache(query, k_cache, v_cache)
    kv_heads = k_cache.shape[2]
    assert block_tables.shape[0] == num_seqs and seq_lens.shape == (num_seqs,), (
        block_tables.shape, seq_lens.shape, query.shape)
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)  # [S, q_heads, head_dim]
    assert out.shape == query.shape and out.stride(-1) == 1, (out.shape, query.shape)
    if num_seqs == 0:
        return out

    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())
        visible = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
        num_splits = choose_num_splits(num_seqs, kv_heads, visible, query.device)
    assert num_splits >= 1, num_splits
    if block_n is None:
        block_n = 16 if interpreting() else 64
    split = num_splits > 1
    if split:
        part_out = torch.empty(  # [S, q_heads, num_splits, head_dim]
            (num_seqs, q_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        part_lse = torch.empty(  # [S, q_heads, num_splits], log2 domain
            (num_seqs, q_heads, num_splits), dtype=torch.float32, device=query.device)
        assert part_out.shape[:3] == part_lse.shape
    else:
        part_out = part_lse = out  # unused

    _decode_split_kernel[(num_seqs, kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens,
        out, part_out, part_lse,
        scale * _LOG2E, sliding_window or 0, num_splits,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0) if split else 0, part_out.stride(1) if split else 0,
        part_out.stride(2) if split else 0,
        part_lse.stride(0) if split else 0, part_lse.stride(1) if split else 0,
        GROUP=group, BLOCK_G=max(16, _next_pow2(group)),
        HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)),
        PAGE_SIZE=page_size, BLOCK_N=block_n,
        SPLIT=split, USE_WINDOW=sliding_window is not None,
        UPCAST=_upcast(query),
        num_warps=4, num_stages=2,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, q_heads)](
            part_out, part_lse, out, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)),
            BLOCK_SPLITS=max(2, _next_pow2(num_splits)),
            num_warps=4,
        )
    return out


def paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for a packed batch of query chunks over their paged context.

    Sequence ``i``'s queries are rows ``cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1``
    of ``query`` and sit at positions ``seq_lens[i] - q_len_i .. seq_lens[i] - 1``;
    each sees the cached prefix and the chunk's tokens up to itself (and, with
    ``sliding_window``, only keys at positions ``> p - sliding_window``). Any
    chunk length works, 1 included, so this also serves mixed prefill/decode steps.

    Args:
        query: ``[T, q_heads, head_dim]``.
        k_cache, v_cache, block_tables, seq_lens, scale, sliding_window: as
            for :func:`paged_decode`.
        cu_seqlens_q: ``[S + 1]`` int32 prefix sums of the chunk lengths.
        max_query_len: the longest chunk, a Python int (sizes the launch grid).
        block_m: query tokens per program (power of two); by default chosen so
            a tile holds about 64 (query token, head) rows.
        block_n: keys per inner-loop tile (power of two >= 16); default 64 (16 under the interpreter).
        out: optional ``[T, q_heads, head_dim]`` output buffer.

    Returns:
        ``[T, q_heads, head_dim]`` in the query's dtype (or ``out``).
    """
    _require_triton()
    total, q_heads, head_dim = query.shape
    group, page_size, _ = _check_cache(query, k_cache, v_cache)
    kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    assert cu_seqlens_q.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs, (
        cu_seqlens_q.shape, block_tables.shape, seq_lens.shape)
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert cu_seqlens_q.dtype == torch.int32
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)  # [T, q_heads, head_dim]
    assert out.shape == query.shape and out.stride(-1) == 1, (out.shape, query.shape)
    if total == 0 or num_seqs == 0:
        return out

    block_g = _next_pow2(group)
    if block_m is None:
        block_m = max(1, 64 // block_g)
        block_m = min(block_m, max(1, _next_pow2(max_query_len)))
    if block_m * block_g < 16:
        block_m = 16 // block_g  # tl.dot needs at least 16 rows
    if block_n is None:
        block_n = 16 if interpreting() else 64
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
        scale * _LOG2E, sliding_window or 0,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=block_g,
        HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)),
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        UPCAST=_upcast(query),
        num_warps=4, num_stages=2,
    )
    return out

