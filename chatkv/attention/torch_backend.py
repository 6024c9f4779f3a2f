"""The portable attention backend: gather each sequence's blocks, then SDPA.

It runs on any device PyTorch supports and is the reference every other
backend is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chatkv.attention.base import AttentionBackend, AttentionMetadata


#: Prefills of at most this many tokens per sequence attend with each KV head's
#: query heads stacked as rows (faster on the CPU below about 32 tokens, level above).
GROUPED_QUERY_MAX = 32


def causal_window_mask(
    q_len: int, kv_len: int, sliding_window: int | None, device: torch.device,
    dtype: torch.dtype = torch.bool,
) -> torch.Tensor | None:
    """Mask ``[q_len, kv_len]`` for a chunk ending at ``kv_len``: boolean (True =
    attend), or for a float ``dtype`` additive (0 = attend, -inf = not).

    The ``q_len`` queries are the last positions ``kv_len - q_len .. kv_len - 1``
    (bottom-right aligned causal mask). Returns None when every key is visible,
    so SDPA can take its unmasked fast path.
    """
    if q_len == 1 and (sliding_window is None or kv_len <= sliding_window):
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    if dtype == torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))


def step_mask(masks: dict | None, q_len: int, kv_len: int, sliding_window: int | None,
              device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """:func:`causal_window_mask` as an additive ``dtype`` mask, made once per
    step and shape: ``masks`` (a step's ``AttentionMetadata.extras`` entry)
    keeps it for the model's other layers. SDPA adds a float mask as it is,
    where it first converts a boolean one (a tenth of a prefill's attention
    time here)."""
    key = (q_len, kv_len, sliding_window, dtype)
    if masks is not None and key in masks:
        return masks[key]
    mask = causal_window_mask(q_len, kv_len, sliding_window, device, dtype)
    if masks is not None:
        masks[key] = mask
    return mask


def _repeated_mask(masks: dict | None, mask: torch.Tensor, group: int) -> torch.Tensor:
    """``mask`` repeated ``group`` times along its rows, kept in ``masks`` for the step's other layers."""
    key = ("repeated", mask.data_ptr(), tuple(mask.shape), group)
    if masks is not None and key in masks:
        return masks[key]
    rows = mask.repeat(group, 1)
    if masks is not None:
        masks[key] = rows
    return rows


def gather_sequence_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, contiguous_start: int = -1
) -> torch.Tensor:
    """Return the first ``seq_len`` rows of a sequence's blocks as ``[seq_len, kv_heads, head_dim]``.

    With ``contiguous_start >= 0`` the blocks are known to be consecutive from
    that block on, and the result is a view (no copy).
    """
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    if contiguous_start >= 0:
        blocks = cache[contiguous_start : contiguous_start + n_blocks]
        return blocks.reshape(n_blocks * block_size, *cache.shape[2:])[:seq_len]
    blocks = cache.index_select(0, block_table[:n_blocks].long())
    return blocks.reshape(n_blocks * block_size, *cache.shape[2:])[:seq_len]


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    contiguous_start: list[int] | None = None,
    masks: dict | None = None,
) -> torch.Tensor:
    """Paged attention for a packed batch, one sequence at a time, via SDPA.

    Args:
        query: ``[T, q_heads, head_dim]``, sequences packed in order.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``.
        block_tables: ``[S, max_blocks]`` int32.
        seq_lens: context length of each sequence (cached + new).
        query_lens: new tokens of each sequence; they sum to ``T``.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: see :meth:`AttentionBackend.forward`.
        contiguous_start: per sequence, the first block when its blocks are
            consecutive in the pool (read as a view), else -1.
        masks: where the step keeps its masks between layers (see :func:`step_mask`).

    Returns:
        ``[T, q_heads, head_dim]``.
    """
    total, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    assert q_heads % kv_heads == 0, (q_heads, kv_heads)
    assert sum(query_lens) == total, (query_lens, total)
    group = q_heads // kv_heads
    out = torch.empty_like(query)
    start = 0
    for i, (kv_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        run = contiguous_start[i] if contiguous_start is not None else -1
        k = gather_sequence_kv(k_cache, block_tables[i], kv_len, run).transpose(0, 1).unsqueeze(0)
        v = gather_sequence_kv(v_cache, block_tables[i], kv_len, run).transpose(0, 1).unsqueeze(0)
        if q_len == 1:
            # Decode: the query heads that share a KV head become that head's
            # queries, all at the last position, so no mask is needed (a window
            # is a slice) and SDPA sees [1, kv_heads, group, D] against
            # [1, kv_heads, L, D]: no GQA expansion, and several queries per
            # head, which CPU SDPA runs several times faster than one.
            lo = kv_len - sliding_window if sliding_window is not None and kv_len > sliding_window else 0
            q = query[start].reshape(kv_heads, group, head_dim).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k[:, :, lo:].to(q.dtype), v[:, :, lo:].to(q.dtype), scale=scale)
            out[start] = o[0].reshape(q_heads, head_dim)
            start += 1
            continue
        q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        mask = step_mask(masks, q_len, kv_len, sliding_window, query.device, query.dtype)
        if group > 1 and q_len <= GROUPED_QUERY_MAX:
            # A short prefill (a chat turn's new message) as decode does it: each KV
            # head's group of query heads as one head of group * q_len rows, the
            # mask repeated per group; the same result, bit for bit, with no GQA
            # expansion of the keys and values (a quarter less time at 21 tokens).
            rows = _repeated_mask(masks, mask, group) if mask is not None else None
            o = F.scaled_dot_product_attention(
                q.reshape(1, kv_heads, group * q_len, head_dim), k.to(q.dtype), v.to(q.dtype),
                attn_mask=rows, scale=scale,
            ).reshape(1, q_heads, q_len, head_dim)  # CUDA's SDPA may return a strided layout
        else:
            o = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                enable_gqa=q_heads != kv_heads,
            )
        out[start : start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


class TorchBackend(AttentionBackend):
    """Gathers each sequence's blocks into a contiguous copy and calls SDPA."""

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`."""
        return paged_attention_reference(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens_list,
            meta.query_lens_list, scale, sliding_window, meta.extras.get("contiguous_start"),
            meta.extras.setdefault("masks", {}),
        )
