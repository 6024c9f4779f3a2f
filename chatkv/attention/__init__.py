"""Attention backends over the paged KV pool, plugged into transformers models.

:func:`attach` registers chatkv's attention function in transformers'
``AttentionInterface`` and switches a model to it. Each forward call then
receives the step's :class:`AttentionMetadata` as the ``chatkv_meta`` keyword
argument; nothing is global.

A model compiled with ``torch.compile`` (:mod:`chatkv.compile`) is called
without that argument: its graph cannot carry a Python object that changes
every step. There each layer's attention is one opaque operator,
``chatkv::paged_attention``, which takes the step's metadata from
:func:`step_metadata`, set by the thread that runs the step.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from chatkv.attention.base import AttentionBackend, AttentionMetadata, write_kv
from chatkv.attention.torch_backend import TorchBackend
from chatkv.ops import define

ATTN_IMPLEMENTATION = "chatkv_paged"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchBackend",
    "attach",
    "get_backend",
    "paged_attention_forward",
    "step_metadata",
]

_STEP = threading.local()


@contextmanager
def step_metadata(meta: AttentionMetadata) -> Iterator[None]:
    """Make ``meta`` the metadata that ``chatkv::paged_attention`` reads in this
    thread until the block ends (for a compiled model, called without
    ``chatkv_meta``). Blocks nest; each thread has its own."""
    previous = getattr(_STEP, "meta", None)
    _STEP.meta = meta
    try:
        yield
    finally:
        _STEP.meta = previous


def _paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     layer: int, scaling: float, sliding_window: int) -> torch.Tensor:
    """One layer's paged attention as an operator ``torch.compile`` leaves opaque
    (``chatkv::paged_attention``): writes the step's keys and values into the
    pool and attends, with the metadata of :func:`step_metadata`
    (``sliding_window`` 0: none). Returns ``[1, T, q_heads, D]``."""
    meta: AttentionMetadata | None = getattr(_STEP, "meta", None)
    if meta is None:
        raise RuntimeError("chatkv::paged_attention ran outside step_metadata(); "
                           "run this model through chatkv's engine")
    return _attend(meta, layer, query, key, value, scaling, sliding_window or None)


def _paged_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          layer: int, scaling: float, sliding_window: int) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


_paged_attention_op = define("paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scaling, "
                             "int sliding_window) -> Tensor", _paged_attention, _paged_attention_fake)


def _attend(meta: AttentionMetadata, layer: int, query: torch.Tensor, key: torch.Tensor,
            value: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Write one layer's new K/V into the pool, attend; ``[1, T, q_heads, D]``."""
    assert query.shape[0] == 1, "chatkv packs sequences along the token axis (batch dim 1)"
    backend = meta.backend or TorchBackend()
    if meta.max_query_len == 1 and len(meta.query_lens_list) == 1:  # one decode row: fewer operator calls
        out = backend.decode_one(meta, layer, query, key, value, scale, sliding_window)
        if out is not None:
            return out
    k_cache, v_cache = meta.kv[layer, 0], meta.kv[layer, 1]
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    write_kv(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), meta.slot_mapping)
    return backend.forward(q, k_cache, v_cache, meta, scale, sliding_window).unsqueeze(0)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: write this step's K/V into the pool, then attend.

    transformers calls it per layer with ``query`` ``[1, q_heads, T, D]`` and
    ``key``/``value`` ``[1, kv_heads, T, D]`` (rotary already applied, KV heads
    not repeated) for the packed batch; the mask transformers would build is
    ignored (``attention_mask`` is None for a registered function), causality
    and windows come from the metadata: the ``chatkv_meta`` keyword argument,
    else (a compiled model) :func:`step_metadata`'s.

    Returns:
        ``([1, T, q_heads, D], None)`` as transformers expects.
    """
    meta: AttentionMetadata | None = kwargs.get("chatkv_meta")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")
    if meta is None:
        if torch.compiler.is_compiling() or getattr(_STEP, "meta", None) is not None:
            out = _paged_attention_op(query, key, value, module.layer_idx, float(scale), int(window or 0))
            return out, None
        raise RuntimeError(
            "chatkv attention was called without chatkv_meta; run this model through chatkv's engine"
        )
    return _attend(meta, module.layer_idx, query, key, value, scale, window), None


def attach(model: Any) -> None:
    """Register chatkv's attention function and make ``model`` use it.

    Idempotent. The model's own modules and weights are untouched.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:  # older transformers
        model.config._attn_implementation = ATTN_IMPLEMENTATION


def get_backend(name: str, device: torch.device, cpu_attention: str = "auto") -> AttentionBackend:
    """The backend called ``name`` (``torch``, ``triton``, ``flex`` or ``auto``) for ``device``.

    ``auto`` picks the fused Triton kernels on CUDA when Triton imports, the
    ``torch`` backend otherwise. ``cpu_attention`` ``"auto"`` lets the
    ``torch`` backend attend a bfloat16 model's rows from position 1,024 on
    by products on the CPU
    (:func:`chatkv.attention.torch_backend.product_attention`); ``"sdpa"``
    keeps SDPA for all.

    Raises:
        ValueError: an unknown name, or ``triton`` asked for where it cannot run
            (no triton package, or neither CUDA nor ``TRITON_INTERPRET=1``).
    """
    products = cpu_attention == "auto"
    if name == "torch":
        return TorchBackend(products)
    if name == "flex":
        from chatkv.attention.flex_backend import FlexBackend

        return FlexBackend()
    if name in ("triton", "auto"):
        from chatkv.attention.triton_backend import TritonBackend

        if name == "triton" or device.type == "cuda":
            if TritonBackend.is_available(device):
                return TritonBackend()
            if name == "triton":
                raise ValueError(
                    "the triton attention backend needs the triton package and CUDA "
                    "(or TRITON_INTERPRET=1 on the CPU)"
                )
        return TorchBackend(products)
    raise ValueError(f"unknown attention backend {name!r}; choose torch, triton, flex or auto")
