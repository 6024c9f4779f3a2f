"""Moving one sequence's KV out of the block pool and back: the tier mechanism.

:func:`offload` copies a sequence's computed KV out of the pool, quantizing
its full blocks with a scheme from :mod:`chatkv.quant` (the partial last block
stays at full precision, KIVI's recent-token window); :func:`reload` writes it
back into an empty sequence. Neither decides *when* to move anything (that is
:mod:`chatkv.tiers`), and neither takes a lock: both touch the pool, so both
run on the engine's loop thread, which owns the pool.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from chatkv.quant import QuantizedKV, dequantize, quantize

if TYPE_CHECKING:
    from chatkv.block_pool import BlockPool
    from chatkv.sequence import Sequence, Shift


@dataclass
class OffloadedKV:
    """A session's KV outside the pool.

    ``k``/``v`` hold the full blocks of every layer as ``[layers * blocks,
    block_size, kv_heads, head_dim]`` (quantized unless the scheme is
    ``none``); ``tail`` is the partial last block at full precision,
    ``[layers, 2, t, kv_heads, head_dim]``.
    """

    token_ids: list[int]
    k: QuantizedKV | None
    v: QuantizedKV | None
    tail: torch.Tensor
    num_layers: int
    scheme: str
    exact: bool
    #: The sequence's window shift (``context_policy="sink"``), restored with the KV.
    shift: "Shift | None" = None

    @property
    def nbytes(self) -> int:
        """Bytes held, codes and scales included."""
        cached = self.__dict__.get("_nbytes")
        if cached is None:
            full = (self.k.nbytes + self.v.nbytes) if self.k is not None and self.v is not None else 0
            cached = self.__dict__["_nbytes"] = full + self.tail.numel() * self.tail.element_size()
        return cached

    @property
    def lossless(self) -> bool:
        """True when reloading gives back exactly the KV that was offloaded."""
        return self.exact and (self.scheme == "none" or self.k is None)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held, in a fixed order (see :meth:`with_tensors`)."""
        out = []
        for q in (self.k, self.v):
            if q is not None:
                out += [t for t in (q.data, q.scale, q.zero) if t is not None]
        return out + [self.tail]

    def with_tensors(self, tensors: list[torch.Tensor]) -> "OffloadedKV":
        """A copy holding ``tensors`` (same order as :meth:`tensors`) instead."""
        it = iter(tensors)

        def take(q: QuantizedKV | None) -> QuantizedKV | None:
            if q is None:
                return None
            data = next(it)
            scale = next(it) if q.scale is not None else None
            zero = next(it) if q.zero is not None else None
            return dataclasses.replace(q, data=data, scale=scale, zero=zero)

        k, v = take(self.k), take(self.v)
        return dataclasses.replace(self, k=k, v=v, tail=next(it))

    def to(self, device: torch.device) -> "OffloadedKV":
        """A copy on ``device``. Off a CUDA device it lands in pinned host memory,
        copied on a side stream (see :mod:`chatkv.transfer`); onto CUDA the
        current stream waits for the side-stream copy."""
        from chatkv import transfer

        tensors = self.tensors()
        if device.type == "cpu":
            moved = transfer.to_host(tensors)
        else:
            moved = transfer.to_device(tensors, device)
        return self.with_tensors(moved)


def offload(pool: "BlockPool", seq: "Sequence", scheme: str) -> OffloadedKV:
    """Copy ``seq``'s computed KV out of the pool (quantizing its full blocks with
    ``scheme``); the sequence and its blocks are left untouched. Runs on the
    pool's owning thread."""
    bs = pool.block_size
    ids = list(seq.computed_ids)
    n = len(ids)
    full = (n // bs) * bs
    L = pool.kv.shape[0]
    dense = pool.read_tokens(seq, 0, full) if full else None
    tail = pool.read_tokens(seq, full, n - full) if n > full else pool.kv.new_empty((L, 2, 0, *pool.kv.shape[4:]))
    k = v = None
    if dense is not None:
        h, d = dense.shape[-2:]
        # [L, 2, full, H, D] -> per K/V: [L * blocks, bs, H, D]
        k = quantize(dense[:, 0].reshape(L * (full // bs), bs, h, d), "k", scheme)
        v = quantize(dense[:, 1].reshape(L * (full // bs), bs, h, d), "v", scheme)
        if scheme == "none":  # quantize() keeps a reference for "none": make it own its memory
            k = dataclasses.replace(k, data=k.data.clone())
            v = dataclasses.replace(v, data=v.data.clone())
    return OffloadedKV(ids, k, v, tail, L, scheme, seq.exact, seq.shift)


def reload(pool: "BlockPool", seq: "Sequence", off: OffloadedKV) -> None:
    """Write offloaded KV back into the pool for empty ``seq`` (dequantizing on the
    pool's device). Lossy KV marks the sequence inexact. Runs on the pool's
    owning thread.

    Raises:
        OutOfBlocksError: the pool cannot hold it (nothing is written).
    """
    L = off.num_layers
    dtype, device = pool.kv.dtype, pool.kv.device
    assert seq.num_computed == 0 and not seq.block_table, "reload needs an empty sequence"
    if off.tail.device != device:
        off = off.to(device)
    parts = []
    if off.k is not None and off.v is not None:
        k = dequantize(off.k, dtype)
        v = dequantize(off.v, dtype)
        h, d = k.shape[-2:]
        parts.append(torch.stack([k.reshape(L, -1, h, d), v.reshape(L, -1, h, d)], dim=1))
    parts.append(off.tail.to(dtype=dtype))
    kv = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    seq.shift = off.shift  # before the write: its blocks are hashed under the shift
    try:
        pool.write_tokens(seq, off.token_ids, kv, exact=off.lossless)
    except BaseException:
        seq.shift = None
        raise
