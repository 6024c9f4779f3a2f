"""A second fused backend: PyTorch's FlexAttention reading the paged pool in place.

The layer's pool is seen as one long key sequence ``[1, kv_heads, num_blocks *
block_size, head_dim]`` (a strided view, no copy) and each sequence's block
table becomes the block-sparse structure of a :class:`BlockMask` whose KV block
size is the pool's block size. Run eagerly, whole blocks are "full" (no mask
evaluated); only a sequence's partial last block, or every block under a
sliding window, runs the mask function. Compiled (the default on CUDA), every
visible block runs the mask function: on an H200 with torch 2.11, Inductor's
flex-decoding kernel given full blocks returned wrong outputs (max error 0.1
to 0.35 against 1e-3 in bf16, pools of 513 and 2,049 blocks of 16), read out
of bounds over a pool of 2,049 blocks, and failed to compile over one of more
than 2**31 elements; without full blocks it matched (tried on the two smaller
pools only).

Decode-only steps use FlexAttention; other steps fall back to the ``torch``
backend (paged causal prefill through FlexAttention would need a per-token
logical-position map and is left out). The block mask depends on the step,
not the layer, so it is built once per step and cached in ``meta.extras``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from chatkv.attention.base import AttentionBackend, AttentionMetadata
from chatkv.attention.torch_backend import paged_attention_reference

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    HAS_FLEX = True
except ImportError:  # torch < 2.5
    HAS_FLEX = False

_MASK_KEY = "flex_decode_block_mask"


def build_decode_block_mask(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    sliding_window: int | None = None,
    full_blocks: bool = True,
) -> "BlockMask":
    """A BlockMask over the flattened pool for one decode query per sequence.

    Args:
        block_tables: ``[S, max_blocks]`` int32 physical block ids.
        seq_lens: ``[S]`` int32 context lengths (the query is the last position).
        num_blocks, block_size: the pool's shape.
        sliding_window: keys at logical positions ``> seq_len - 1 - sliding_window`` only.
        full_blocks: mark a sequence's whole blocks "full" (no mask evaluated
            on them); False runs the mask on every visible block (see the
            module doc: the compiled kernel needs it). Both give the same result.

    Returns:
        A mask for queries ``[S, H, 1, D]`` against keys ``[S, Hkv, num_blocks * block_size, D]``.
    """
    num_seqs, max_blocks = block_tables.shape
    device = block_tables.device
    tables = block_tables.long()
    lens = seq_lens.long()
    n_used = (lens + block_size - 1) // block_size  # [S]
    cols = torch.arange(max_blocks, device=device)
    # Logical block of each physical block, per sequence (-1 where it is not theirs).
    phys_to_logical = torch.full((num_seqs, num_blocks), -1, dtype=torch.long, device=device)  # [S, NB]
    owned = cols[None, :] < n_used[:, None]
    rows = torch.arange(num_seqs, device=device)[:, None].expand_as(tables)
    phys_to_logical[rows[owned], tables[owned]] = cols[None, :].expand_as(tables)[owned]
    assert phys_to_logical.shape == (num_seqs, num_blocks)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        logical = phys_to_logical[b, kv_idx // block_size]
        pos = logical * block_size + kv_idx % block_size
        ok = (logical >= 0) & (pos < lens[b])
        if sliding_window is not None:
            ok = ok & (pos >= lens[b] - sliding_window)
        return ok

    def sparse(idx: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [S, 1 head, 1 query block, ...]
        return count.to(torch.int32).view(num_seqs, 1, 1), idx.to(torch.int32).view(num_seqs, 1, 1, -1)

    if sliding_window is None and full_blocks:
        n_full = lens // block_size
        partial = (lens % block_size > 0).long()
        last = tables.gather(1, n_full.clamp(max=max_blocks - 1)[:, None])  # [S, 1]
        kv_num, kv_idx = sparse(last, partial)
        full_num, full_idx = sparse(tables, n_full)
    else:
        # The first visible logical block: 0, or where the window starts.
        first = torch.zeros_like(lens)
        if sliding_window is not None:
            first = (lens - sliding_window).clamp(min=0) // block_size
        shift = (cols[None, :] + first[:, None]).clamp(max=max_blocks - 1)
        kv_num, kv_idx = sparse(tables.gather(1, shift), n_used - first)
        full_num = full_idx = None
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(128, block_size), mask_mod=mask_mod,
        seq_lengths=(1, num_blocks * block_size), compute_q_blocks=False,
    )


def _pool_as_sequence(cache: torch.Tensor, batch: int) -> torch.Tensor:
    """``[NB, BS, Hkv, D]`` -> ``[batch, Hkv, NB * BS, D]``, a view (batch broadcast, stride 0)."""
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    flat = cache.view(num_blocks * block_size, kv_heads, head_dim).permute(1, 0, 2)
    return flat.unsqueeze(0).expand(batch, kv_heads, num_blocks * block_size, head_dim)


class FlexBackend(AttentionBackend):
    """FlexAttention over the paged pool for decode steps; the torch path otherwise."""

    name = "flex"

    def __init__(self, compile: bool | None = None, kernel_options: dict | None = None) -> None:
        """``compile``: wrap flex_attention in torch.compile (default: on CUDA only)."""
        self._compile = compile
        self._kernel_options = kernel_options
        self._fns: dict[bool, Callable[..., torch.Tensor]] = {}

    @staticmethod
    def is_available(device: torch.device | str | None = None) -> bool:
        """True when this torch has FlexAttention (compiled on CUDA, eager elsewhere)."""
        return HAS_FLEX

    def _compiled(self, device: torch.device) -> bool:
        """Whether steps on ``device`` run FlexAttention through torch.compile."""
        return self._compile if self._compile is not None else device.type == "cuda"

    def _flex(self, device: torch.device) -> Callable[..., torch.Tensor]:
        compiled = self._compiled(device)
        if compiled not in self._fns:
            self._fns[compiled] = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
        return self._fns[compiled]

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
        if not meta.is_decode_only:
            return paged_attention_reference(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens_list,
                meta.query_lens_list, scale, sliding_window,
            )
        num_seqs, q_heads, head_dim = query.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        key = (_MASK_KEY, sliding_window)
        mask = meta.extras.get(key)
        if mask is None:
            mask = build_decode_block_mask(
                meta.block_tables, meta.seq_lens, num_blocks, block_size, sliding_window,
                full_blocks=not self._compiled(query.device),
            )
            meta.extras[key] = mask
        q = query.unsqueeze(2)  # [S, Hq, 1, D]
        with warnings.catch_warnings():
            # Off CUDA the unfused eager path is the intended one; its warning is noise.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = self._flex(query.device)(
                q, _pool_as_sequence(k_cache, num_seqs).to(query.dtype),
                _pool_as_sequence(v_cache, num_seqs).to(query.dtype),
                block_mask=mask, scale=scale, enable_gqa=q_heads != kv_heads,
                kernel_options=self._kernel_options,
            )
        assert out.shape == (num_seqs, q_heads, 1, head_dim), out.shape
        return out.squeeze(2)
