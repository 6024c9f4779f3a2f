"""KV-cache quantization schemes for idle sessions' blocks.

A scheme turns a stack of full KV blocks ``[n, block_size, kv_heads, head_dim]``
(one layer's K or V, any float dtype) into a :class:`QuantizedKV` and back.
Schemes are looked up by name; the name is stored with every quantized tensor
(:meth:`QuantizedKV.meta`) so a chunk file says how to read itself.

``"none"``
    Full precision: the tensor is kept as is (a reference, not a copy).
``"bf16"``, ``"fp16"``
    The values cast to bfloat16 / float16 (``data`` only): half the bytes of
    float32 KV, no scales. A no-op for KV already in that dtype.
``"int8"``
    Symmetric, per token and head. ``data`` int8 ``[n, BS, H, D]`` in
    ``[-127, 127]``; ``scale`` float32 ``[n, BS, H]``; ``x ~= data * scale``.
``"fp8"``
    ``torch.float8_e4m3fn``, scaled per token and head so the largest magnitude
    maps to 448 (e4m3's largest finite value). ``data`` ``[n, BS, H, D]``;
    ``scale`` float32 ``[n, BS, H]``; ``x ~= data.float() * scale``.
``"int4"``
    4-bit asymmetric after KIVI (Liu et al., 2024): keys per channel, values per
    token. Both store ``data`` uint8 ``[n, BS, H, D // 2]``, two 4-bit codes per
    byte (channel ``2j`` in the low nibble, ``2j + 1`` in the high one), and
    ``x ~= code * scale + zero`` with float16 ``scale``/``zero``:

    * keys: one (scale, zero) per (block, head, channel), the group being the
      block's ``BS`` tokens: ``scale``/``zero`` ``[n, H, D]``. Outlier channels,
      common in keys, get their own range instead of stretching every token's.
    * values: one (scale, zero) per (block, token, head, group of ``G``
      channels), ``G = 32`` (or ``head_dim`` when it is smaller or not a
      multiple of 32): ``scale``/``zero`` ``[n, BS, H, D // G]``.

    float16 parameters bound the magnitudes this scheme can hold to 65504,
    far above the KV of models we know; int8 and fp8 keep float32 scales.

    KIVI keeps the most recent tokens in full precision. chatkv gets that from
    the engine: only full blocks are ever quantized, and a session's partial last
    block (up to ``block_size - 1`` of its newest tokens) stays at full precision.

Quantized copies are dequantized into the full-precision pool when a session
comes back (:mod:`chatkv.offload`); the attention kernels read full precision only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Kind = Literal["k", "v"]

SCHEMES: tuple[str, ...] = ("none", "bf16", "fp16", "int8", "fp8", "int4")
#: The dtype each cast scheme stores.
CAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: Largest finite value of float8 e4m3fn.
FP8_MAX = 448.0
INT8_MAX = 127
INT4_LEVELS = 15
#: Channels per value group of the int4 scheme (KIVI's group size).
INT4_GROUP = 32

# Metadata keys under which a QuantizedKV describes itself (string values, so
# they fit safetensors' metadata and any tool can read them).
_META_KEYS = ("quant_scheme", "quant_kind", "quant_shape", "quant_dtype", "quant_group")

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}


def check_scheme(scheme: str) -> str:
    """Return ``scheme`` if it names a known scheme, else raise ``ValueError``."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown KV quantization scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    return scheme


def int4_group_size(head_dim: int) -> int:
    """Channels per value group for the int4 scheme at this ``head_dim``."""
    return INT4_GROUP if head_dim % INT4_GROUP == 0 else head_dim


@dataclass(frozen=True, eq=False)
class QuantizedKV:
    """One layer's K or V blocks in a quantized (or full-precision) form.

    Attributes:
        scheme: one of :data:`SCHEMES`.
        kind: ``"k"`` or ``"v"`` (int4 treats them differently).
        shape: the original ``(n, block_size, kv_heads, head_dim)``.
        dtype: the original float dtype, the default of :func:`dequantize`.
        data: the codes (or, for ``"none"``, the tensor itself).
        scale: per-group scales; ``None`` for ``"none"``.
        zero: per-group offsets (int4 only), else ``None``.
        group_size: channels per value group (int4), else 0.
    """

    scheme: str
    kind: Kind
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    data: Tensor
    scale: Tensor | None = None
    zero: Tensor | None = None
    group_size: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors (codes plus scales and offsets)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def device(self) -> torch.device:
        """The device the codes live on."""
        return self.data.device

    def tensors(self) -> dict[str, Tensor]:
        """The tensors by name (``data``, ``scale``, ``zero``), contiguous, ready for safetensors."""
        out = {"data": self.data.contiguous()}
        if self.scale is not None:
            out["scale"] = self.scale.contiguous()
        if self.zero is not None:
            out["zero"] = self.zero.contiguous()
        return out

    def meta(self) -> dict[str, str]:
        """String metadata that, with :meth:`tensors`, fully describes this object."""
        return {
            "quant_scheme": self.scheme,
            "quant_kind": self.kind,
            "quant_shape": ",".join(str(s) for s in self.shape),
            "quant_dtype": str(self.dtype).removeprefix("torch."),
            "quant_group": str(self.group_size),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], meta: dict[str, str]) -> QuantizedKV:
        """Rebuild from :meth:`tensors` and :meth:`meta` (extra keys are ignored).

        Raises:
            ValueError: unknown scheme, kind or dtype, a missing key, or tensors
                whose shapes or dtypes do not match the scheme's layout.
        """
        missing = [k for k in _META_KEYS if k not in meta]
        if missing:
            raise ValueError(f"quantized KV metadata lacks {missing}")
        scheme = check_scheme(meta["quant_scheme"])
        kind = meta["quant_kind"]
        if kind not in ("k", "v"):
            raise ValueError(f"quant_kind must be 'k' or 'v', got {kind!r}")
        if meta["quant_dtype"] not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {meta['quant_dtype']!r}")
        dims = tuple(int(s) for s in meta["quant_shape"].split(","))
        if len(dims) != 4:
            raise ValueError(f"quant_shape must have 4 dims, got {meta['quant_shape']!r}")
        if "data" not in tensors:
            raise ValueError("quantized KV tensors lack 'data'")
        q = cls(
            scheme=scheme,
            kind=kind,  # type: ignore[arg-type]
            shape=dims,  # type: ignore[arg-type]
            dtype=_DTYPES[meta["quant_dtype"]],
            data=tensors["data"],
            scale=tensors.get("scale"),
            zero=tensors.get("zero"),
            group_size=int(meta["quant_group"]),
        )
        _validate(q)
        return q


def _expected_layout(
    scheme: str, kind: Kind, shape: tuple[int, int, int, int], dtype: torch.dtype, group: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the tensors a scheme stores for blocks of ``shape``."""
    n, bs, h, d = shape
    if scheme == "none":
        return {"data": (shape, dtype)}
    if scheme in CAST_DTYPES:
        return {"data": (shape, CAST_DTYPES[scheme])}
    if scheme == "int8":
        return {"data": (shape, torch.int8), "scale": ((n, bs, h), torch.float32)}
    if scheme == "fp8":
        return {"data": (shape, torch.float8_e4m3fn), "scale": ((n, bs, h), torch.float32)}
    packed = ((n, bs, h, d // 2), torch.uint8)
    if kind == "k":
        return {"data": packed, "scale": ((n, h, d), torch.float16), "zero": ((n, h, d), torch.float16)}
    return {
        "data": packed,
        "scale": ((n, bs, h, d // group), torch.float16),
        "zero": ((n, bs, h, d // group), torch.float16),
    }


def _validate(q: QuantizedKV) -> None:
    """Raise ``ValueError`` unless ``q``'s tensors match its scheme's layout."""
    if q.scheme == "int4" and (q.shape[3] % 2 or q.group_size != int4_group_size(q.shape[3])):
        raise ValueError(f"int4 needs an even head_dim and group {int4_group_size(q.shape[3])}, "
                         f"got head_dim {q.shape[3]}, group {q.group_size}")
    expected = _expected_layout(q.scheme, q.kind, q.shape, q.dtype, q.group_size)
    got = q.tensors()
    if set(got) != set(expected):
        raise ValueError(f"{q.scheme} KV needs tensors {sorted(expected)}, got {sorted(got)}")
    for name, (shape, dtype) in expected.items():
        t = got[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"{q.scheme} {q.kind} tensor {name!r}: expected {dtype} {list(shape)}, "
                f"got {t.dtype} {list(t.shape)}"
            )


# --- the schemes -------------------------------------------------------------


def _safe(scale: Tensor) -> Tensor:
    """``scale`` with zeros replaced by ones, so all-zero groups divide cleanly."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _cast_to(scheme: str) -> Callable[[Tensor, Kind], dict[str, Tensor]]:
    def cast(x: Tensor, kind: Kind) -> dict[str, Tensor]:
        return {"data": x.to(CAST_DTYPES[scheme])}
    return cast


def _dequant_cast(q: QuantizedKV) -> Tensor:
    return q.data


def _quant_int8(x: Tensor, kind: Kind) -> dict[str, Tensor]:
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX  # [n, BS, H]
    data = torch.round(xf / _safe(scale)[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return {"data": data, "scale": scale}


def _dequant_int8(q: QuantizedKV) -> Tensor:
    assert q.scale is not None
    return q.data.float() * q.scale[..., None]


def _quant_fp8(x: Tensor, kind: Kind) -> dict[str, Tensor]:
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / FP8_MAX  # [n, BS, H]
    # Clamp first: a value rounding a hair above 448 would become NaN in e4m3fn.
    data = (xf / _safe(scale)[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"data": data, "scale": scale}


def _dequant_fp8(q: QuantizedKV) -> Tensor:
    assert q.scale is not None
    if q.data.device.type != "cpu":
        return q.data.float() * q.scale[..., None]
    half = _fp8_as_scaled_half(q.data, torch.empty(q.data.shape, dtype=torch.int16))
    return half.float().mul_(q.scale[..., None] * FP8_HALF_SHIFT)


#: :func:`_fp8_as_scaled_half` gives an e4m3fn code's value divided by this.
FP8_HALF_SHIFT = 256.0


def _fp8_as_scaled_half(codes: Tensor, scratch: Tensor) -> Tensor:
    """float16 values of e4m3fn ``codes`` divided by :data:`FP8_HALF_SHIFT`,
    exactly, written into ``scratch`` (int16, the shape of ``codes``) and
    returned as a float16 view of it.

    On the CPU torch widens float8 one element at a time (31 ms for 21 M
    values here); these are four vectorized integer passes. e4m3fn's sign,
    four exponent bits and three mantissa bits become float16's sign, the low
    four bits of its exponent and its top three mantissa bits. For normal and
    subnormal codes alike that float16 is the code's value times 2**-8 (its
    exponent bias is 15 against e4m3's 7), and every such value is exact in
    float16. The two NaN codes, which :func:`quantize` never writes (it clamps
    to 448), read as 480: keeping them NaN tripled the time.
    """
    assert scratch.dtype == torch.int16 and scratch.shape == codes.shape, (scratch.dtype, scratch.shape, codes.shape)
    scratch.copy_(codes.view(torch.uint8))
    # byte << 8 puts the sign in bit 15; the arithmetic >> 1 moves the seven
    # exponent and mantissa bits to 13..7 and copies the sign into bit 14, cleared after.
    scratch.bitwise_left_shift_(8).bitwise_right_shift_(1).bitwise_and_(~0x4000)
    return scratch.view(torch.float16)


def _pack_nibbles(codes: Tensor) -> Tensor:
    """``[..., D]`` uint8 codes in [0, 15] -> ``[..., D // 2]`` uint8."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`_pack_nibbles`: ``[..., D // 2]`` -> ``[..., D]`` uint8.

    Each byte widened to 16 bits as ``(b | b << 4) & 0x0F0F`` holds its low
    nibble in its low byte and its high nibble in its high byte: on a
    little-endian machine, the codes in order. Three contiguous passes,
    where writing every other byte (the big-endian way) ran 4.7x slower.
    """
    if sys.byteorder != "little":
        codes = torch.empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=torch.uint8, device=packed.device)
        torch.bitwise_and(packed, 0x0F, out=codes[..., 0::2])
        torch.bitwise_right_shift(packed, 4, out=codes[..., 1::2])
        return codes
    wide = packed.to(torch.int16)
    wide.bitwise_or_(wide << 4).bitwise_and_(0x0F0F)
    return wide.view(torch.uint8)


def _asym_params(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """float16 (scale, zero) for the range [lo, hi], each shaped like ``lo``."""
    zero = lo.to(torch.float16)
    scale = ((hi - zero.float()) / INT4_LEVELS).to(torch.float16)
    return scale, zero


def _quant_int4(x: Tensor, kind: Kind) -> dict[str, Tensor]:
    n, bs, h, d = x.shape
    xf = x.float()
    if kind == "k":
        # One range per (block, head, channel), over the block's tokens.
        scale, zero = _asym_params(xf.amin(dim=1), xf.amax(dim=1))  # [n, H, D]
        s, z = scale.float()[:, None], zero.float()[:, None]  # [n, 1, H, D]
        codes = torch.round((xf - z) / _safe(s))
    else:
        g = int4_group_size(d)
        xg = xf.reshape(n, bs, h, d // g, g)
        scale, zero = _asym_params(xg.amin(dim=-1), xg.amax(dim=-1))  # [n, BS, H, D/G]
        s, z = scale.float()[..., None], zero.float()[..., None]
        codes = torch.round((xg - z) / _safe(s)).reshape(n, bs, h, d)
    codes = codes.clamp_(0, INT4_LEVELS).to(torch.uint8)
    data = _pack_nibbles(codes)
    assert data.shape == (n, bs, h, d // 2)
    return {"data": data, "scale": scale, "zero": zero}


def _dequant_int4(q: QuantizedKV) -> Tensor:
    out = torch.empty(q.shape, dtype=torch.float32, device=q.data.device)
    dequantize_int4_blocks_into(q, 0, q.shape[0], out)
    return out


def dequantize_int4_blocks_into(q: QuantizedKV, lo: int, hi: int, out: Tensor) -> None:
    """Write blocks ``lo .. hi - 1`` of the int4 ``q`` into ``out`` (float32,
    contiguous, ``[hi - lo, block_size, kv_heads, head_dim]``): the same
    values, bit for bit, as :func:`dequantize` gives for them in float32
    (codes times scale, then plus zero, each rounded in float32). Taking a
    range of blocks at a time bounds the float32 scratch a caller needs
    (:data:`ROW_TILE_ELEMS`), where the whole chunk would need a float32
    copy of its own."""
    assert q.scheme == "int4" and q.scale is not None and q.zero is not None, q.scheme
    n, (_, bs, h, d) = hi - lo, q.shape
    assert out.dtype == torch.float32 and out.is_contiguous() and tuple(out.shape) == (n, bs, h, d), out.shape
    out.copy_(_unpack_nibbles(q.data[lo:hi]))
    if q.kind == "k":  # one range per (block, head, channel), over the block's tokens
        out.mul_(q.scale[lo:hi].float()[:, None]).add_(q.zero[lo:hi].float()[:, None])
        return
    g = q.group_size
    cg = out.view(n, bs, h, d // g, g)
    cg.mul_(q.scale[lo:hi].float()[..., None]).add_(q.zero[lo:hi].float()[..., None])


_QUANTIZERS: dict[str, Callable[[Tensor, Kind], dict[str, Tensor]]] = {
    "bf16": _cast_to("bf16"),
    "fp16": _cast_to("fp16"),
    "int8": _quant_int8,
    "fp8": _quant_fp8,
    "int4": _quant_int4,
}
_DEQUANTIZERS: dict[str, Callable[[QuantizedKV], Tensor]] = {
    "bf16": _dequant_cast,
    "fp16": _dequant_cast,
    "int8": _dequant_int8,
    "fp8": _dequant_fp8,
    "int4": _dequant_int4,
}


# --- public API --------------------------------------------------------------


def quantize(x: Tensor, kind: Kind, scheme: str) -> QuantizedKV:
    """Quantize a stack of full KV blocks.

    Args:
        x: one layer's keys or values, ``[n, block_size, kv_heads, head_dim]``,
            float16, bfloat16, float32 or float64, on any device.
        kind: ``"k"`` for keys, ``"v"`` for values.
        scheme: one of :data:`SCHEMES`.

    Returns:
        A :class:`QuantizedKV` on ``x``'s device. For ``"none"`` it holds ``x``
        itself (no copy). Otherwise ``x`` is not modified and not referenced.

    Raises:
        ValueError: unknown scheme or kind, ``x`` not 4-D or not a supported
            float dtype, or (int4) an odd ``head_dim``.
    """
    check_scheme(scheme)
    if kind not in ("k", "v"):
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    if x.dim() != 4:
        raise ValueError(f"expected blocks [n, block_size, kv_heads, head_dim], got shape {list(x.shape)}")
    if x.dtype not in _DTYPES.values():
        raise ValueError(f"expected a float KV tensor, got {x.dtype}")
    shape = tuple(x.shape)
    group = 0
    if scheme == "int4":
        if shape[3] % 2:
            raise ValueError(f"int4 packs two channels per byte; head_dim {shape[3]} is odd")
        group = int4_group_size(shape[3])
    if scheme == "none":
        parts = {"data": x}
    else:
        parts = _QUANTIZERS[scheme](x, kind)
    q = QuantizedKV(scheme=scheme, kind=kind, shape=shape, dtype=x.dtype,  # type: ignore[arg-type]
                    data=parts["data"], scale=parts.get("scale"), zero=parts.get("zero"),
                    group_size=group)
    _validate(q)
    return q


def dequantize(q: QuantizedKV, dtype: torch.dtype | None = None) -> Tensor:
    """Reconstruct the blocks of ``q``.

    Args:
        q: what :func:`quantize` (or :meth:`QuantizedKV.from_tensors`) returned.
        dtype: the result's dtype; defaults to the dtype that was quantized.

    Returns:
        A new tensor ``[n, block_size, kv_heads, head_dim]`` on ``q``'s device
        (for ``"none"`` in the same dtype, ``q.data`` itself).
    """
    dtype = dtype or q.dtype
    if q.scheme == "none":
        return q.data.to(dtype)
    out = _DEQUANTIZERS[q.scheme](q).to(dtype)
    assert tuple(out.shape) == q.shape
    return out


#: Schemes whose parameters are per token (or none): any range of a block's
#: tokens dequantizes alone, straight into its destination (:func:`dequantize_rows_into`).
ROWWISE_SCHEMES = ("bf16", "fp16", "int8", "fp8")


#: Elements per tile when :func:`dequantize_rows_into` (and int4's unpacking)
#: goes through float32 scratch on the CPU: 4 MB of float32. Tiles of 1 MB,
#: sized for the core's L2, made three times as many operator calls, and an
#: int8 restore of 1.9k tokens took 13.5 to 13.8 ms against 11.4 to 11.6 with
#: these (two A/B runs, 16 restores each, tiles alternating in one engine).
ROW_TILE_ELEMS = 1 << 20


def dequantize_rows_into(scheme: str, data: Tensor, scale: Tensor | None, out: Tensor) -> None:
    """Write the dequantized codes ``data`` (``[..., head_dim]``, with ``scale``
    ``[...]`` per row, None for the cast schemes) into ``out``, a tensor of the
    same shape in any float dtype, strided or not (a slice of the block pool):
    the same values, bit for bit, as :func:`dequantize` then ``.to(out.dtype)``,
    with no full-precision copy of the whole in between. For the
    :data:`ROWWISE_SCHEMES`.

    int8 and fp8 are computed in float32 and rounded once to ``out``'s dtype.
    On the CPU that goes a tile at a time (:data:`ROW_TILE_ELEMS`) through
    float32 scratch: an in-place multiply of bfloat16 by float32 scales runs
    one element at a time there (65 ms for 21 M values against 8 ms this way),
    and fp8 codes are widened through their bits (:func:`_fp8_as_scaled_half`).
    float16 into bfloat16 (or back) goes through the same scratch: the direct
    conversion is scalar too (9 ms against 4.5).

    Raises:
        ValueError: ``scheme`` is not row-wise.
    """
    if scheme not in ROWWISE_SCHEMES:
        raise ValueError(f"{scheme!r} is not a row-wise scheme ({', '.join(ROWWISE_SCHEMES)})")
    if scheme in CAST_DTYPES and (data.dtype == out.dtype or out.dtype == torch.float32 or out.device.type != "cpu"):
        out.copy_(data)
        return
    assert scale is not None or scheme in CAST_DTYPES
    if out.device.type != "cpu":
        # Widen into out exactly (int8 and e4m3 fit every float dtype), then
        # scale in place, computed in float32 and rounded once.
        assert scale is not None
        out.copy_(data)
        out.mul_(scale.unsqueeze(-1))
        return
    limit = min(ROW_TILE_ELEMS, out.numel())
    wide = None if out.dtype == torch.float32 else torch.empty(limit, dtype=torch.float32)
    bits = torch.empty(limit, dtype=torch.int16) if scheme == "fp8" else None
    for o, d, s in _row_tiles(limit, out, data, scale):
        acc = o if wide is None else wide[: o.numel()].view(o.shape)
        if scale is None:  # float16 into bfloat16 or back: both ways through float32 are vectorized
            acc.copy_(d)
        elif bits is None:  # int8
            assert s is not None
            acc.copy_(d)
            acc.mul_(s.unsqueeze(-1))
        else:  # fp8: value / 256 from the bits, times scale * 256 (exact: a power of two)
            assert s is not None
            acc.copy_(_fp8_as_scaled_half(d, bits[: d.numel()].view(d.shape)))
            acc.mul_(s.unsqueeze(-1) * FP8_HALF_SHIFT)
        if acc is not o:
            o.copy_(acc)


def _row_tiles(limit: int, out: Tensor, data: Tensor, scale: Tensor | None,
               ) -> Iterator[tuple[Tensor, Tensor, Tensor | None]]:
    """Matching slices of ``out``, ``data`` (``[..., D]``) and ``scale``
    (``[...]``, or None) along their leading dimensions, each of at most
    ``limit`` elements of ``out`` where a row of ``D`` allows it."""
    if out.numel() <= limit or out.dim() <= 1:
        yield out, data, scale
        return
    per = out[0].numel()
    if per > limit and out.dim() > 2:
        for i in range(out.shape[0]):
            yield from _row_tiles(limit, out[i], data[i], None if scale is None else scale[i])
        return
    step = max(1, limit // per)
    for a in range(0, out.shape[0], step):
        yield out[a: a + step], data[a: a + step], None if scale is None else scale[a: a + step]


def bytes_per_token(
    scheme: str,
    kv_heads: int,
    head_dim: int,
    num_layers: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Bytes one cached token costs under ``scheme``, keys and values of all layers.

    Scales and offsets are included; the int4 key parameters, one set per block,
    are amortized over ``block_size`` tokens. ``dtype`` is the full-precision
    element type, used by ``"none"`` only. Equal to ``nbytes / (n * block_size)``
    summed over K and V of every layer, for ``n`` quantized full blocks.
    """
    check_scheme(scheme)
    elems = kv_heads * head_dim  # per token, per layer, per K or V
    k: float
    v: float
    if scheme == "none":
        k = v = elems * torch.empty((), dtype=dtype).element_size()
    elif scheme in CAST_DTYPES:
        k = v = elems * 2
    elif scheme in ("int8", "fp8"):
        k = v = elems + kv_heads * 4
    else:
        k = elems / 2 + 2 * 2 * elems / block_size
        v = elems / 2 + 2 * 2 * kv_heads * (head_dim // int4_group_size(head_dim))
    return float(num_layers * (k + v))
