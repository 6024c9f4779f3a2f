"""The attention backend interface and the per-step metadata it receives.

A backend computes attention for a packed batch of sequences whose keys and
values live in the paged block pool.  The model itself is untouched: chatkv
registers one function in transformers' ``AttentionInterface`` and hands each
forward call an :class:`AttentionMetadata` as a keyword argument, so no state
is global and several engines can run side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs to know about one packed forward step.

    The batch packs ``S`` sequences along the token axis (no padding). Sequence
    ``i`` contributes ``query_lens[i]`` new tokens, which sit at absolute
    positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``; its keys and
    values for positions ``0 .. seq_lens[i] - 1`` are in the blocks listed by
    ``block_tables[i]`` once this step has written the new ones.

    Attributes:
        kv: the pool tensor, ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``.
        slot_mapping: ``[T]`` int64, flat slot (``block * block_size + offset``)
            where each new token's K/V is written.
        block_tables: ``[S, max_blocks]`` int32, padded with 0 past a sequence's blocks.
        seq_lens: ``[S]`` int32, context length of each sequence after this step.
        cu_seqlens_q: ``[S + 1]`` int32, prefix sums of the query lengths.
        seq_lens_list / query_lens_list: the same lengths as Python ints, so the
            CPU path never synchronises with the device to read them.
        max_query_len: the longest query chunk in the batch (1 for pure decode).
        backend: the backend that computes attention for this step.
    """

    kv: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens_list: list[int]
    query_lens_list: list[int]
    max_query_len: int
    backend: "AttentionBackend | None" = None
    extras: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        """Number of sequences packed in this step."""
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence contributes exactly one new token."""
        return self.max_query_len == 1


class AttentionBackend:
    """Computes paged attention for one layer of one packed step.

    Subclasses implement :meth:`forward`. ``name`` is what users pass as
    ``attention_backend=`` in the engine config.
    """

    name: str = "base"

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Attend the packed ``query`` ``[T, q_heads, head_dim]`` over the paged cache.

        ``k_cache``/``v_cache`` are one layer's ``[num_blocks, block_size,
        kv_heads, head_dim]`` views, already holding this step's keys and
        values. Query head ``h`` reads KV head ``h // (q_heads // kv_heads)``
        (grouped-query attention; KV heads are never repeated in memory).
        ``sliding_window`` (tokens) limits each query at position ``p`` to keys
        at positions ``> p - sliding_window``.

        Returns:
            ``[T, q_heads, head_dim]`` in the query's dtype.
        """
        raise NotImplementedError

    def decode_one(
        self,
        meta: AttentionMetadata,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor | None:
        """A shortcut for a step of one decode row: write layer ``layer``'s new
        key and value (``[1, kv_heads, 1, head_dim]``) into the pool and attend
        ``query`` (``[1, q_heads, 1, head_dim]``), returning ``[1, 1, q_heads,
        head_dim]`` exactly as writing them (:func:`write_kv`) and calling
        :meth:`forward` would; or None, having written nothing, where the
        backend has no such shortcut or it does not apply to ``meta`` (the
        caller then takes the general path). This base class has none."""
        return None


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys and values ``[T, kv_heads, head_dim]`` in place at ``slot_mapping``.

    The pool is never concatenated or reallocated: the flat view of each layer's
    cache is indexed by slot.
    """
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    assert key.shape == value.shape and key.shape[1:] == (kv_heads, head_dim), (key.shape, k_cache.shape)
    assert slot_mapping.shape == (key.shape[0],), (slot_mapping.shape, key.shape)
    k_flat = k_cache.view(num_blocks * block_size, kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, kv_heads, head_dim)
    k_flat.index_copy_(0, slot_mapping, key.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_flat.dtype))
