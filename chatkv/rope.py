"""Shifting cached keys' rotary positions in place (the ``sink`` context policy).

A key in the pool is stored after its rotary embedding: ``RoPE(k, p) = m *
R(p θ) k``, where ``R`` rotates each pair of channels ``(i, i + d/2)`` by
``p θ_i`` (transformers' ``rotate_half`` layout, the one every Llama-family
model uses) and ``m`` is the variant's attention scaling (1 except for YaRN).
Rotations compose, so ``R(-δ θ) RoPE(k, p) = RoPE(k, p - δ)`` exactly (up to
float rounding) whenever ``θ`` does not depend on the position or the sequence
length: the default RoPE and the ``linear``, ``llama3``, ``yarn`` and
``proportional`` scalings (their ``θ`` and ``m`` are fixed at load time).
``dynamic`` NTK scaling and ``longrope`` recompute ``θ`` from the sequence
length, so a key computed at one length cannot be moved to another exactly:
those (and models without a rotary embedding, or of a family whose attention
is not known to use ``rotate_half``) are refused with
:class:`~chatkv.errors.ConfigError`.

:func:`shift_blocks` applies the shift to whole blocks of the pool in place,
on the engine's loop (the pool's owner).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from chatkv.errors import ConfigError

#: RoPE variants whose frequencies are fixed at load time: a shift is exact.
SHIFTABLE_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
#: Model families whose attention applies RoPE with transformers' ``rotate_half``
#: to the whole head (so the pool's keys rotate as this module assumes).
ROTATE_HALF_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class RopeShift:
    """How to move a model's cached keys to earlier positions.

    Attributes:
        inv_freq: the ``θ_i`` (``[head_dim / 2]`` float64, CPU) the model's rotary embedding uses.
        rope_type: the variant (``default``, ``llama3``, ...).
    """

    inv_freq: torch.Tensor
    rope_type: str

    @property
    def head_dim(self) -> int:
        """Channels per head the rotation covers."""
        return 2 * self.inv_freq.numel()

    def cos_sin(self, delta: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` of the rotation by ``-delta`` positions, ``[head_dim]`` each
        (computed in float64, so the shift adds no error of its own beyond rounding to ``dtype``)."""
        angle = -float(delta) * self.inv_freq
        emb = torch.cat((angle, angle))
        return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)

    def shift(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """``keys`` (``[..., head_dim]``, already rotary-embedded at positions ``p``)
        as if embedded at ``p - delta``: ``RoPE(k, p) -> RoPE(k, p - delta)``."""
        if delta == 0:
            return keys
        work = torch.float32 if keys.dtype in (torch.float16, torch.bfloat16) else keys.dtype
        k = keys.to(work)
        cos, sin = self.cos_sin(delta, k.device, work)
        half = k.shape[-1] // 2
        rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
        return (k * cos + rotated * sin).to(keys.dtype)


def _rotary_module(model: Any) -> Any | None:
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is not None:
        return rotary
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "rope_type"):
            return module
    return None


def rope_shift_for(model: Any) -> RopeShift:
    """The exact key shift of ``model``'s rotary embedding.

    Raises:
        ConfigError: positions of this model cannot be shifted exactly (no
            rotary embedding, a length-dependent variant such as ``dynamic``
            NTK scaling or ``longrope``, multimodal or per-layer RoPE, partial
            rotary dimensions, or a family not known to use ``rotate_half``).
    """
    config = model.config
    family = getattr(config, "model_type", None)
    if family not in ROTATE_HALF_FAMILIES:
        raise ConfigError(f"context_policy='sink' needs a model whose keys can be shifted exactly; "
                          f"{family!r} models are not supported (supported: {', '.join(ROTATE_HALF_FAMILIES)})")
    rotary = _rotary_module(model)
    if rotary is None or not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        raise ConfigError("context_policy='sink' needs a rotary position embedding; this model has none")
    rope_type = getattr(rotary, "rope_type", "default")
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope_type, str) or (isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())):
        raise ConfigError("context_policy='sink' does not support per-layer rotary embeddings")
    if isinstance(params, dict) and params.get("mrope_section"):
        raise ConfigError("context_policy='sink' does not support multimodal (mrope) rotary embeddings")
    if "dynamic" in rope_type or rope_type not in SHIFTABLE_ROPE_TYPES:
        raise ConfigError(
            f"context_policy='sink' cannot shift positions exactly under {rope_type!r} RoPE scaling (its "
            f"frequencies depend on the sequence length); use context_policy='trim' (shiftable: "
            f"{', '.join(SHIFTABLE_ROPE_TYPES)})")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = rotary.inv_freq.detach().to("cpu", torch.float64)
    if 2 * inv_freq.numel() != head_dim or not bool(torch.isfinite(inv_freq).all()):
        raise ConfigError("context_policy='sink' does not support partial rotary embeddings")
    return RopeShift(inv_freq, rope_type)


def shift_blocks(kv: torch.Tensor, blocks: list[int], delta: int, rope: RopeShift) -> None:
    """Rotate the keys of pool ``blocks`` back by ``delta`` positions, in place.

    ``kv`` is the pool tensor ``[layers, 2, num_blocks, block_size, kv_heads,
    head_dim]``; values are position-free and stay as they are. The caller
    owns the blocks exclusively (copy on write first if they are shared).
    """
    if not blocks or delta == 0:
        return
    index = torch.tensor(blocks, dtype=torch.long, device=kv.device)
    # Advanced indexing writes only these blocks (index_copy_ on the strided
    # K view would copy the whole pool's keys).
    kv[:, 0, index] = rope.shift(kv[:, 0, index], delta)
