"""Compact chunk payloads: a chunk's KV ``[L, 2, n, H, D]`` as quantized blocks plus an exact tail.

``TierConfig.disk_format`` other than ``exact`` writes chunk files through
:func:`pack`: the chunk's full blocks of ``block_size`` tokens are quantized
per layer with a :mod:`chatkv.quant` scheme, the partial last block (the
newest tokens, as the quantized tiers do) stays in the model's dtype. The
format and block size are part of the chunk's ``kv_format`` (see
:func:`packed_format`), so packed and exact chunks never share a hash, and
:func:`unpack` needs nothing else to read one back.

Tensor names: ``k.<part>`` and ``v.<part>`` for the quantized keys and values
of all layers' full blocks stacked (``[L * blocks, block_size, H, D]`` before
quantization; ``<part>`` is ``data``, ``scale`` or ``zero``), and ``tail``
(``[L, 2, n % block_size, H, D]``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from chatkv import quant
from chatkv.quant import (
    CAST_DTYPES,
    ROWWISE_SCHEMES,
    QuantizedKV,
    check_scheme,
    dequantize,
    dequantize_int4_blocks_into,
    dequantize_rows_into,
    int4_group_size,
    quantize,
)

PACKED_TAG = "packed-"


def packed_format(version: str, scheme: str, block_size: int) -> str:
    """The ``kv_format`` base of chunks packed with ``scheme`` in blocks of ``block_size``."""
    return f"{version}:{PACKED_TAG}{check_scheme(scheme)}.b{block_size}"


def parse_packed(base: str, version: str) -> tuple[str, int] | None:
    """``(scheme, block_size)`` of a packed ``kv_format`` base, None for any other base.

    Raises:
        ValueError: a packed base that does not parse (unknown scheme, bad block size).
    """
    prefix = f"{version}:{PACKED_TAG}"
    if not base.startswith(prefix):
        return None
    scheme, sep, bs = base[len(prefix):].rpartition(".b")
    if not sep or not bs.isdigit() or int(bs) < 1:
        raise ValueError(f"not a packed KV format: {base!r}")
    return check_scheme(scheme), int(bs)


def pack(kv: torch.Tensor, scheme: str, block_size: int) -> dict[str, torch.Tensor]:
    """``kv`` ``[L, 2, n, H, D]`` as compact tensors (see the module doc). ``kv`` is not modified."""
    L, two, n, h, d = kv.shape
    full = (n // block_size) * block_size
    out: dict[str, torch.Tensor] = {"tail": kv[:, :, full:].contiguous()}
    if full:
        blocks = kv[:, :, :full].reshape(L, 2, full // block_size, block_size, h, d)
        for i, kind in enumerate(("k", "v")):
            q = quantize(blocks[:, i].reshape(-1, block_size, h, d), kind, scheme)  # type: ignore[arg-type]
            out.update({f"{kind}.{name}": t.clone() if scheme == "none" else t
                        for name, t in q.tensors().items()})
    return out


def unpack(tensors: dict[str, torch.Tensor], scheme: str, block_size: int,
           shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """The KV ``[L, 2, n, H, D]`` (``shape``) in ``dtype`` that :func:`pack` stored in ``tensors``.

    Raises:
        ValueError: tensors missing or of the wrong layout for ``scheme`` and ``shape``.
    """
    L, two, n, h, d = shape
    full, tail, parts = _parts(tensors, scheme, block_size, shape, dtype)
    if not full:
        return tail.to(dtype)
    out = torch.empty(shape, dtype=dtype, device=tail.device)  # filled in place: no stack, no cat
    wide = dtype if scheme in CAST_DTYPES else torch.float32  # computed in float32, rounded once into out
    for i, q in enumerate(parts):
        out[:, i, :full] = dequantize(q, wide).reshape(L, full, h, d)
    out[:, :, full:] = tail
    return out


def unpack_into(tensors: dict[str, torch.Tensor], scheme: str, block_size: int,
                shape: tuple[int, int, int, int, int], targets: list[tuple[int, torch.Tensor]]) -> None:
    """Write what :func:`unpack` would return straight into ``targets``: each
    ``(first, out)`` receives tokens ``first .. first + out.shape[2] - 1`` of
    the KV ``[L, 2, n, H, D]`` (``shape``), ``out`` being ``[L, 2, count, H, D]``
    (a slice of the block pool, strided; on a device, the codes are moved
    there and dequantized there). The same values bit for bit, with no dense
    copy of the chunk in between: row-wise schemes dequantize each run of
    rows where it belongs; int4, whose keys share a range per block, a few
    layers at a time through float32 scratch (:data:`chatkv.quant.ROW_TILE_ELEMS`).

    Raises:
        ValueError: tensors missing or of the wrong layout for ``scheme`` and ``shape``.
    """
    L, two, n, h, d = shape
    dtype = targets[0][1].dtype if targets else torch.float32
    full, tail, parts = _parts(tensors, scheme, block_size, shape, dtype)
    device = targets[0][1].device if targets else tail.device  # codes move, not the dense KV
    tail = tail.to(device)
    for first, out in targets:
        last = first + out.shape[2]
        assert 0 <= first and last <= n and out.shape[:2] == (L, two), (first, tuple(out.shape), shape)
        if last > full:  # the exact tail
            lo = max(first, full)
            out[:, :, lo - first:].copy_(tail[:, :, lo - full: last - full])
    if not full:
        return
    if scheme == "int4":
        _int4_into(parts, L, full, block_size, targets, device)
        return
    if scheme not in ROWWISE_SCHEMES:  # "none": a packed format chatkv never writes, but one it reads
        dense = unpack(tensors, scheme, block_size, shape, dtype).to(device)
        for first, upto, out in _quantized_spans(targets, full):
            out[:, :, : upto - first].copy_(dense[:, :, first:upto])
        return
    rows = [(q.data.reshape(L, full, h, d).to(device),
             None if q.scale is None else q.scale.reshape(L, full, h).to(device)) for q in parts]
    for first, upto, out in _quantized_spans(targets, full):
        for i, (data, scale) in enumerate(rows):
            dequantize_rows_into(scheme, data[:, first:upto], None if scale is None else scale[:, first:upto],
                                 out[:, i, : upto - first])


#: The codes' dtype of each scheme in a packed chunk but "none".
PACKED_CODES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8,
                                        **CAST_DTYPES}


@dataclass(frozen=True)
class PackedPart:
    """Where a packed chunk keeps its keys' or values' quantized tokens (see
    :func:`packed_layout`): the tensor of ``codes``, read ``row`` elements at
    a time, each row (a head's channels; for int4 a token's, all heads) times
    its float32 ``scale`` (None for a cast scheme). int4: ``code * scale +
    zero`` with float16 ``scale`` and ``zero`` tensors holding a row of them
    per ``block`` rows (keys) or ``row // group`` per row (values)."""

    codes: str
    row: int
    scale: str | None
    zero: str | None = None
    block: int = 0
    group: int = 0


def packed_layout(shapes: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], scheme: str, block_size: int,
                  shape: tuple[int, int, int, int, int], dtype: torch.dtype,
                  ) -> tuple[int, list[PackedPart]] | None:
    """Where a chunk :func:`pack` wrote with ``scheme`` (any but "none")
    keeps the KV ``[L, 2, n, H, D]`` (``shape``) of a pool of ``dtype``, for
    reading it straight into the pool (:class:`chatkv.storage.Converted`):
    ``(full, parts)``, ``full`` the tokens in quantized blocks and ``parts``
    the K and V :class:`PackedPart` (their codes layer by layer, token by
    token: ``[L * full // block_size, block_size, H, ...]``); what they
    dequantize to, rounded once to ``dtype``, is what :func:`unpack` gives,
    bit for bit. Tokens ``full .. n - 1`` are ``tail`` (``[L, 2, n - full, H,
    D]``, in ``dtype``). None unless ``shapes`` (the chunk's tensors, by
    name, with their dtypes) are exactly that: such a chunk is read by
    :func:`unpack_into`, which says what is wrong with it."""
    L, two, n, h, d = shape
    if scheme not in PACKED_CODES or (scheme == "int4" and d % 2):
        return None
    full = (n // block_size) * block_size
    want: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {"tail": (dtype, (L, two, n - full, h, d))}
    parts: list[PackedPart] = []
    for kind in ("k", "v") if full else ():
        blocks = (L * (full // block_size), block_size, h)
        codes, scale, zero = f"{kind}.data", f"{kind}.scale", f"{kind}.zero"
        if scheme == "int4":
            group = int4_group_size(d)
            want[codes] = (torch.uint8, (*blocks, d // 2))
            params = (blocks[0], h, d) if kind == "k" else (*blocks, d // group)
            want[scale] = want[zero] = (torch.float16, params)
            parts.append(PackedPart(codes, h * d, scale, zero, block_size if kind == "k" else 0,
                                    group if kind == "v" else 0))
            continue
        want[codes] = (PACKED_CODES[scheme], (*blocks, d))
        if scheme in CAST_DTYPES:
            parts.append(PackedPart(codes, d, None))
        else:
            want[scale] = (torch.float32, blocks)
            parts.append(PackedPart(codes, d, scale))
    return (full, parts) if dict(shapes) == want else None


def _quantized_spans(targets: list[tuple[int, torch.Tensor]], full: int
                     ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(first, upto, out)`` for each target of :func:`unpack_into` that holds
    quantized tokens: its tokens ``first .. upto - 1`` are below ``full`` (the
    rest of ``out``, past them, is the exact tail's)."""
    for first, out in targets:
        upto = min(first + out.shape[2], full)
        if first < upto:
            yield first, upto, out


def _int4_into(parts: list[QuantizedKV], layers: int, full: int, block_size: int,
               targets: list[tuple[int, torch.Tensor]], device: torch.device) -> None:
    """The quantized tokens (``0 .. full - 1``) of int4 K and V ``parts`` into
    ``targets`` (see :func:`unpack_into`), dequantized a few layers at a time."""
    nb = full // block_size
    per_layer = full * parts[0].shape[2] * parts[0].shape[3]
    step = max(1, quant.ROW_TILE_ELEMS // per_layer) if device.type == "cpu" else layers
    wide = torch.empty(min(step, layers) * per_layer, dtype=torch.float32, device=device)
    for i, q in enumerate(parts):
        q = dataclasses.replace(q, data=q.data.to(device), scale=q.scale.to(device),  # type: ignore[union-attr]
                                zero=q.zero.to(device))  # type: ignore[union-attr]
        for l0 in range(0, layers, step):
            l1 = min(layers, l0 + step)
            tile = wide[: (l1 - l0) * per_layer].view((l1 - l0) * nb, *q.shape[1:])
            dequantize_int4_blocks_into(q, l0 * nb, l1 * nb, tile)
            rows = tile.view(l1 - l0, full, *q.shape[2:])
            for first, upto, out in _quantized_spans(targets, full):
                out[l0:l1, i, : upto - first].copy_(rows[:, first:upto])


def _parts(tensors: dict[str, torch.Tensor], scheme: str, block_size: int,
           shape: tuple[int, int, int, int, int], dtype: torch.dtype,
           ) -> tuple[int, torch.Tensor, list[QuantizedKV]]:
    """``(tokens in full blocks, the exact tail, [K, V] quantized)`` of a packed
    chunk, its layout checked (no quantized parts when it has no full block).

    Raises:
        ValueError: tensors missing or of the wrong layout for ``scheme`` and ``shape``.
    """
    L, two, n, h, d = shape
    full = (n // block_size) * block_size
    tail = tensors.get("tail")
    if tail is None or tuple(tail.shape) != (L, two, n - full, h, d) or not tail.is_floating_point():
        raise ValueError(f"packed KV tail is {None if tail is None else (tail.dtype, tuple(tail.shape))}, "
                         f"not {(L, two, n - full, h, d)}")
    if not full:
        return 0, tail, []
    meta = {"quant_scheme": scheme, "quant_shape": f"{L * (full // block_size)},{block_size},{h},{d}",
            "quant_dtype": str(dtype).removeprefix("torch."),
            "quant_group": str(int4_group_size(d) if scheme == "int4" else 0)}
    parts = []
    for kind in ("k", "v"):
        prefix = f"{kind}."
        mine = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
        parts.append(QuantizedKV.from_tensors(mine, {**meta, "quant_kind": kind}))
    return full, tail, parts
