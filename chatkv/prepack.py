"""Linear layers with weights pre-packed for oneDNN, on the CPU.

A decode step multiplies one token's activations by every weight matrix of
the model: on the CPU that is a matrix-vector product per linear layer, and
PyTorch's default path re-lays the weight out for oneDNN (or calls a GEMV that
does not reach memory bandwidth) on every call. Packing each weight once, at
load, into oneDNN's blocked layout (what ``torch.compile``'s CPU freezing pass
does, and Intel's extension) and calling oneDNN's linear directly roughly
halves the time of those products in bfloat16 on this project's Xeon (AMX),
and speeds float32 prefill too; the results are the same to the last bit in
bfloat16 and to rounding in float32.

Projections of one input are packed as one product instead (and not each
on its own): a layer's ``q_proj``, ``k_proj`` and ``v_proj``, and its MLP's
``gate_proj`` and ``up_proj`` (without biases). At one token a oneDNN call
costs more than the bytes it reads: the three attention projections of
SmolLM2 took 66 µs a layer as three calls and 25 µs as one here. The
model's code is not changed: each member layer still returns its own part.
Run as they are, the first member called computes the whole product and
hands the others their parts when they are called with the same input; in a
compiled graph each member calls one operator on all the members' weights
(``chatkv::packed_linear_group``) and a pass chatkv adds to Inductor's
(:mod:`chatkv.compile`) keeps one call per input. oneDNN computes each
output column of the joint product as it does alone: the results are the
same bit for bit (tested). A member whose weight changed multiplies on its
own, unpacked, until :func:`prepack` runs again.

:func:`prepack` switches a model's ``nn.Linear`` modules to
:class:`PackedLinear` (same parameters, plus the packed copy);
:func:`unpack` switches them back, for a stock copy of the model. Where the
oneDNN ops are missing or disagree with ``F.linear`` on a probe, nothing is
changed and the reason is logged.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from chatkv.ops import define

log = logging.getLogger(__name__)

#: dtypes whose linears are packed.
PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies through a oneDNN-packed copy of its weight.

    ``weight`` and ``bias`` stay the module's parameters (state dicts, copies
    and fingerprints see the stock layer). The packed copy lives outside the
    module, keyed by it (oneDNN's tensors cannot be copied or pickled): a
    ``copy.deepcopy`` of the model, or a layer whose weight changed since it
    was packed, computes with plain ``F.linear``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, through oneDNN with the packed weight when it is current
        (for a member of a joint product, its columns of that product)."""
        group: "_Group | None" = getattr(self, "_chatkv_group", None)
        if group is not None:
            return group.member_forward(self._chatkv_member, self, x)
        if torch.compiler.is_compiling():
            # Traced by torch.compile (chatkv.compile): one opaque operator, which
            # finds the packed copy at run time (inductor cannot lower oneDNN's op
            # on a weight packed outside its graph).
            return _packed_linear_op(x, self.weight, self.bias)
        entry = _PACKED.get(self)
        if (entry is None or entry[0] != _weight_key(self.weight) or x.dtype != self.weight.dtype
                or x.device.type != "cpu" or torch.is_grad_enabled()):
            return F.linear(x, self.weight, self.bias)
        return _linear_pointwise(x, entry[1], self.bias, "none", [], "")


def _linear_pointwise(*args: Any) -> torch.Tensor:
    """oneDNN's linear, resolved to its overload once (the op packet's lookup costs per call)."""
    global _linear_pointwise
    _linear_pointwise = torch.ops.mkldnn._linear_pointwise.default
    return _linear_pointwise(*args)


#: module -> (the weight it was packed from, the packed weight).
_PACKED: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, int], torch.Tensor]]" = weakref.WeakKeyDictionary()
#: weight key -> the packed weight, for the compiled path (which sees weights, not modules).
_BY_WEIGHT: "dict[tuple[int, int], torch.Tensor]" = {}
#: (linear shape, row count) pairs :func:`warm_row_counts` has run in this process.
_WARMED: set[tuple] = set()


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a compiled graph (``chatkv::packed_linear``):
    through oneDNN with the packed copy of ``weight`` when :func:`prepack` made
    one and it is current."""
    packed = _BY_WEIGHT.get(_weight_key(weight))
    if packed is None or packed.shape != weight.shape or x.dtype != weight.dtype or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    return _linear_pointwise(x, packed, bias, "none", [], "")


def _packed_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _packed_group(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """``x`` times every one of ``weights`` (no biases), the outputs side by side
    along the last dimension (``chatkv::packed_linear_group``): one oneDNN
    product with the packed joint copy when :func:`prepack` made one and every
    weight is current."""
    packed = _BY_GROUP.get(tuple(_weight_key(w) for w in weights))
    if packed is None or x.dtype != weights[0].dtype or x.device.type != "cpu":
        return torch.cat([F.linear(x, w) for w in weights], -1)
    return _linear_pointwise(x, packed, None, "none", [], "")


def _packed_group_fake(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


_packed_linear_op = define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
                           _packed_linear, _packed_linear_fake)
_packed_group_op = define("packed_linear_group(Tensor x, Tensor[] weights) -> Tensor",
                          _packed_group, _packed_group_fake)


#: The members' weight keys -> their joint packed weight, for the compiled path.
_BY_GROUP: "dict[tuple[tuple[int, int], ...], torch.Tensor]" = {}
#: Attribute names of the layers that share one input, per parent module, packed as one product.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Group:
    """Linear layers of one parent that multiply the same input, packed as one
    product; each member keeps its own parameters and returns its own columns."""

    def __init__(self, members: list[nn.Linear]) -> None:
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.key = tuple(_weight_key(m.weight) for m in members)
        with torch.inference_mode():
            joint = torch.cat([m.weight.detach() for m in members])
            self.packed = torch.ops.mkldnn._reorder_linear_weight(joint, 1)
        #: Run as they are: (the input, its version, its parts not yet handed out, by member index).
        self._pending: tuple[torch.Tensor, int, dict[int, torch.Tensor]] | None = None

    def current(self) -> bool:
        """Whether no member's weight changed (in place or replaced) since it was packed."""
        return self.key == tuple(_weight_key(m.weight) for m in self.members)

    def member_forward(self, i: int, member: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """The output for ``x`` of ``member``, the ``i``-th: its columns of the joint product."""
        if torch.compiler.is_compiling():
            # Every member calls the same operator on the same inputs; the graph computes it once.
            whole = _packed_group_op(x, [m.weight for m in self.members])
            start = sum(self.sizes[:i])
            return whole.narrow(-1, start, self.sizes[i])
        pending = self._pending
        if pending is not None and pending[0] is x and pending[1] == _version(x) and i in pending[2]:
            part = pending[2].pop(i)
            if not pending[2]:
                self._pending = None
            return part
        if (x.dtype != member.weight.dtype or x.device.type != "cpu" or torch.is_grad_enabled()
                or not self.current()):
            return F.linear(x, member.weight, member.bias)
        parts = list(_linear_pointwise(x, self.packed, None, "none", [], "").split(self.sizes, -1))
        # The others' parts wait for them, held with the input they belong to (an
        # identity and version check: a new or changed input computes again).
        self._pending = (x, _version(x), {j: p for j, p in enumerate(parts) if j != i})
        return parts[i]

    def __deepcopy__(self, memo: dict) -> None:
        """A copy of the model multiplies layer by layer (its weights were never packed)."""
        return None

    def __reduce__(self) -> tuple:
        """Pickled as None, as copied: oneDNN's packed tensor cannot be pickled."""
        return (type(None), ())


def _version(x: torch.Tensor) -> int:
    """``x``'s in-place version (-1 for an inference tensor, which keeps none)."""
    return -1 if x.is_inference() else x._version


def _group_members(model: Any) -> list[list[nn.Linear]]:
    """The sets of :data:`GROUPS` layers in ``model`` that can share a product:
    CPU linears of one dtype in :data:`PACKED_DTYPES`, the same input size,
    no biases."""
    found = []
    for parent in model.modules():
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, nn.Linear) for m in members):
                continue
            first = members[0]
            if all(m.bias is None and m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
                   and m.weight.device.type == "cpu" and first.weight.dtype in PACKED_DTYPES for m in members):
                found.append(members)
    return found


def _weight_key(w: torch.Tensor) -> tuple[int, int]:
    """Identifies a weight's current contents: its storage and in-place version."""
    return w.data_ptr(), w._version


def _ops_available() -> str | None:
    """None if the oneDNN linear ops can be used here, else why not."""
    if os.environ.get("CHATKV_PREPACK", "") == "0":
        return "CHATKV_PREPACK=0"
    if not torch.backends.mkldnn.is_available():
        return "PyTorch was built without oneDNN"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return "this PyTorch has no oneDNN packed-linear ops"
    return None


def _probe(dtype: torch.dtype) -> str | None:
    """None if packed linears agree with ``F.linear`` in ``dtype``, else why not."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(3, 40, generator=g).to(dtype)
    try:
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 1), b,
                                                     "none", [], "")
            want = F.linear(x, w, b)
    except RuntimeError as e:
        return f"oneDNN refused {dtype}: {e}"
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
        return f"oneDNN's packed linear disagrees with F.linear in {dtype}"
    return None


def prepack(model: Any) -> int:
    """Pack the weights of every CPU ``nn.Linear`` of ``model`` in float32 or
    bfloat16 for oneDNN, in place; returns how many layers now compute
    packed (0 where the ops are unavailable, with the reason logged, or the
    model is elsewhere). Idempotent: a layer is packed again only if its
    weight changed."""
    why = _ops_available()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)
               and m.weight.device.type == "cpu" and m.weight.dtype in PACKED_DTYPES]
    if not linears:
        return 0
    if why is None:
        for dtype in {m.weight.dtype for m in linears}:
            why = why or _probe(dtype)
    if why is not None:
        log.info("linear layers are not pre-packed: %s", why)
        return 0
    grouped = _group_members(model)
    in_group = {id(m) for members in grouped for m in members}
    with torch.inference_mode():
        for m in linears:
            key = _weight_key(m.weight)
            entry = _PACKED.get(m)
            if id(m) in in_group:  # its group's joint copy computes it: no copy of its own
                if entry is not None:
                    _BY_WEIGHT.pop(entry[0], None)
                    del _PACKED[m]
            elif entry is None or entry[0] != key:
                if entry is not None:
                    _BY_WEIGHT.pop(entry[0], None)
                _PACKED[m] = (key, torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 1))
                _BY_WEIGHT[key] = _PACKED[m][1]
                weakref.finalize(m, _BY_WEIGHT.pop, key, None)  # a freed weight's address is reused
            m.__class__ = PackedLinear
        for members in grouped:
            old = getattr(members[0], "_chatkv_group", None)
            if old is not None and old.current() and all(a is b for a, b in zip(old.members, members)):
                continue
            group = _Group(members)
            if old is not None:
                _BY_GROUP.pop(old.key, None)
            _BY_GROUP[group.key] = group.packed
            weakref.finalize(members[0], _BY_GROUP.pop, group.key, None)
            for i, m in enumerate(members):
                m._chatkv_group, m._chatkv_member = group, i
    return len(linears)


def warm_row_counts(model: Any, rows: range, head_rows: int) -> int:
    """Run each distinct packed linear shape of ``model`` (:func:`prepack`) once
    for every input row count in ``rows`` (the output projection only up to
    ``head_rows``: it sees one row per sequence of a step), on zeros; returns
    the calls made. A shape and row count already run by this function in
    this process is not run again (oneDNN's cache is the process's).

    oneDNN builds and caches a kernel for each input shape the first time it
    sees one: about 2 ms per weight shape here, so a first prefill of a new
    length paid about 8 ms for SmolLM2 before computing anything. The cache
    holds 1024 kernels by default; warming more shapes than that evicts the
    first ones again. Nothing is kept or changed but that cache.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    shapes: dict[tuple, PackedLinear] = {}
    for m in model.modules():
        if not isinstance(m, PackedLinear):
            continue
        group = getattr(m, "_chatkv_group", None)
        if group is not None:  # a member runs its group's joint product
            shapes.setdefault((m.in_features, sum(group.sizes), m.weight.dtype, False, False), m)
        elif _PACKED.get(m) is not None:
            shapes.setdefault((m.in_features, m.out_features, m.weight.dtype, m.bias is not None, m is head), m)
    calls = 0
    with torch.inference_mode():
        for n in rows:
            for key, m in shapes.items():
                features, _, dtype, _, is_head = key
                if (is_head and n > head_rows) or (key, n) in _WARMED:
                    continue
                m(torch.zeros(1, n, features, dtype=dtype))
                _WARMED.add((key, n))
                calls += 1
    return calls


def unpack(model: Any) -> int:
    """Turn every :class:`PackedLinear` of ``model`` back into a stock ``nn.Linear``
    (dropping the packed copies); returns how many."""
    n = 0
    for m in model.modules():
        group = m.__dict__.pop("_chatkv_group", None)
        m.__dict__.pop("_chatkv_member", None)
        if group is not None:
            _BY_GROUP.pop(group.key, None)
        if isinstance(m, PackedLinear):
            m.__class__ = nn.Linear
            entry = _PACKED.pop(m, None)
            if entry is not None:
                _BY_WEIGHT.pop(entry[0], None)
            n += 1
    return n
