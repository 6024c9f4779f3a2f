"""chatkv's operators for compiled graphs (``torch.ops.chatkv``).

A compiled step calls each of them as an opaque operator: the packed linear
layers (:mod:`chatkv.prepack`) and each layer's paged attention
(:mod:`chatkv.attention`), about 150 calls in a SmolLM2 decode step. They
are defined through ``torch.library.Library`` directly rather than
``torch.library.custom_op``, whose Python wrapper around the kernel cost
about 2.7 µs more per call here (24.7 against 22.0 µs for a one-row joint
product whose oneDNN call takes 18 µs): 0.4 ms of a 17 ms step. Such an
operator gets no autograd formula and no checks of its outputs' aliasing,
which chatkv needs neither of: it runs them under inference mode, and each
returns a new tensor.
"""

from __future__ import annotations

from typing import Callable

import torch

_LIB = torch.library.Library("chatkv", "DEF")


def define(schema: str, kernel: Callable[..., torch.Tensor],
           fake: Callable[..., torch.Tensor]) -> "torch._ops.OpOverload":
    """Define ``chatkv::<schema>`` with ``kernel`` for every device and
    ``fake`` for tracing (shapes only); returns the operator to call. The
    kernel must return a new tensor, never a view of an input."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"chatkv::{name}", fake, lib=_LIB)
    return getattr(torch.ops.chatkv, name).default
