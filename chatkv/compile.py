"""Decode steps compiled with ``torch.compile``, one graph per batch size, and
one-sequence prefill steps, one graph for every token count.

At SmolLM2's size a decode step on the CPU is bound by per-operator overhead,
not by memory bandwidth: of a 33 ms step at 1k tokens of context, the linear
layers take about half, and the rest is some 450 small operators (RMS norms,
rotary embedding, activations, residual adds), each a dispatch and a pass
over memory. Inductor fuses them into a few loops per layer, which makes the
step about 1.2x faster here (SmolLM2 in bfloat16, 2 threads).

What is compiled is the whole model for a decode step of ``B`` sequences (``B``
tokens, one per sequence) with static shapes, one graph per size in
``EngineConfig.compile_batch_sizes``, as vLLM and SGLang capture a graph per
batch-size bucket. A decode step of fewer sequences than a compiled size runs
through the smallest such graph, padded with rows that write and read only a
block of their own (:meth:`chatkv.runner.ModelRunner.pad_step`); their logits
are dropped. Every other step (prefill, teacher forcing, a batch larger than
every size) runs the model as it is. The two places the graph must not
look into are operators of their own: each layer's attention
(``chatkv::paged_attention``, which reads the step's metadata from
:func:`chatkv.attention.step_metadata`, as vLLM's forward context does) and,
where the model is pre-packed for oneDNN, each linear layer
(``chatkv::packed_linear``). Neither graph embeds weights, so Inductor's
on-disk cache serves the next process: compiling takes about 25 s the first
time on this project's machine and about 7 s after that.

A second graph covers prefill steps of one sequence (a chat turn's new
message, a fresh prompt, a chunk of a long one): :class:`PrefillGraph`, the
same model with the number of new tokens symbolic, so one graph serves every
message length (about 1.1x faster prefill here; ``EngineConfig.compile_prefill``).
It is compiled after the decode graphs, in the same thread: about 30 s the
first time, 8 s from Inductor's cache.

Compiling runs in a thread of its own after the engine's warm-up, never on
the loop; the loop switches to the graphs when they are ready. Steps the
graphs would need to be compiled again for (a guard that fails) run the
model as it is instead (``torch.compiler.set_stance("eager_on_recompile")``),
so the loop never stalls on a compile. Where compiling fails, the engine
keeps running the model as it is, and says why in the log.

The compiled step computes the same function with operators fused: its
logits differ from the eager step's in the last bits (float rounding), and
the greedy tokens in all the equivalence tests are the same. ``"auto"``
compiles on the CPU only. On CUDA this module never compiles: the engine
captures the decode step as CUDA graphs instead (:mod:`chatkv.cuda_graphs`),
which removes the per-kernel launch cost that dominates a GPU's decode step.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import time
import types
from typing import Any, Callable

import torch

from chatkv.attention import AttentionBackend, AttentionMetadata, step_metadata
from chatkv.errors import ConfigError

log = logging.getLogger(__name__)

#: One compile at a time in a process: Dynamo's tracing of one model from two
#: threads at once fails (and each compile wants every core anyway).
_COMPILE_LOCK = threading.Lock()

COMPILE_ENV = "CHATKV_COMPILE"
#: The stance compiled steps run under: a step whose guards fail runs the model
#: as it is rather than compiling on the loop (tests set "fail_on_recompile").
RUN_STANCE = "eager_on_recompile"


def _compile_options() -> dict[str, Any]:
    """``torch.compile``'s options for chatkv's graphs.

    - A pass after Inductor's own that keeps one ``chatkv::packed_linear_group``
      call per input and weights. Each member of a jointly packed product
      (:mod:`chatkv.prepack`: a layer's q, k and v projections) calls that
      operator on the same input and weights and keeps its own columns;
      Inductor does not always merge such calls itself (it did for a
      bfloat16 model here, not for a float32 one), so without this pass the
      product could run once per member.
    - No guards on the model's modules (``guard_filter_fn``, where this
      PyTorch has it). Dynamo checks a graph's guards before every call;
      SmolLM2's decode graph has about 7,500, nearly all on its modules'
      attributes and parameters, and checking them took about 1.4 ms of a
      17 ms decode step, 0.13 ms with those left out (``torch.profiler``'s
      "TorchDynamo Cache Lookup"; the bytecode that fetches the parameters
      then takes 0.3 ms instead of 0.1; keeping only the parameters'
      tensor guards, or only the constants', still cost 0.87 and 0.56 ms).
      That is sound here because each graph is compiled from a function of
      its own (:func:`_step_function`), so its entries can only ever be
      called with the one model they were traced from, and the engine owns
      that model: nothing changes its modules' attributes after the graphs
      are built (its weights are read at every call, never baked in). The
      guards on the inputs (shapes, dtypes) and on global state stay.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass

    import chatkv.prepack  # noqa: F401  (registers the operator)

    class MergeGroupProducts(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            target = torch.ops.chatkv.packed_linear_group.default
            first: dict[tuple, torch.fx.Node] = {}
            for node in list(graph.nodes):
                if node.op != "call_function" or node.target is not target:
                    continue
                key = (node.args[0], tuple(node.args[1]))
                kept = first.setdefault(key, node)
                if kept is not node:  # the same product, computed above
                    node.replace_all_uses_with(kept)
                    graph.erase_node(node)

        def uuid(self) -> str:
            return "chatkv-merge-group-products-1"  # in Inductor's cache keys

    options: dict[str, Any] = {"post_grad_custom_post_pass": MergeGroupProducts()}
    skip_module_guards = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    if skip_module_guards is not None:
        options["guard_filter_fn"] = skip_module_guards
    return options


#: Numbers the step functions :func:`_step_function` makes, for their code objects' names.
_STEP_FUNCTIONS = itertools.count()


def _step_function(model: Any) -> Callable[..., Any]:
    """``step(input_ids, position_ids, logits_to_keep)``: ``model`` called on
    them without a cache, as a function whose code object is its own.

    Dynamo keeps what it compiles on the code object of the function called,
    and ``torch.compile(model)`` would compile transformers' forward (or the
    wrapper its decorators put around every model's forward): one code
    object shared by every model of a class in the process, told apart only
    by the guards on their modules. A copy of the code object per graph
    keeps each graph's entries to one model, so those guards can go
    (:func:`_compile_options`), and the decode graphs' calls never check the
    prefill graph's guards first, nor the other way round.
    """
    def step(input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: int) -> Any:
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=logits_to_keep)

    code = step.__code__
    name = f"chatkv_step_{next(_STEP_FUNCTIONS)}"
    own = code.replace(co_name=name, **({"co_qualname": name} if hasattr(code, "co_qualname") else {}))
    return types.FunctionType(own, step.__globals__, name, step.__defaults__, step.__closure__)


#: Accepted ``EngineConfig.compile`` / ``$CHATKV_COMPILE`` spellings and what they mean.
_CHOICES = {"auto": "auto", "on": True, "true": True, "1": True, "yes": True,
            "off": False, "false": False, "0": False, "no": False}


def parse_compile(value: "str | bool | None") -> "str | bool":
    """``value`` (or ``$CHATKV_COMPILE`` where None, else ``"auto"``) as ``True``,
    ``False`` or ``"auto"``.

    Raises:
        ConfigError: a spelling that is none of auto/on/off (true/false, 1/0, yes/no).
    """
    if isinstance(value, bool):
        return value
    if value is None:
        value = os.environ.get(COMPILE_ENV) or "auto"
    choice = _CHOICES.get(str(value).strip().lower())
    if choice is None:
        raise ConfigError(f"compile must be 'auto', 'on' or 'off', got {value!r}")
    return choice


def unavailable(device: torch.device) -> str | None:
    """None if decode steps can be compiled on ``device`` here, else why not."""
    try:
        import torch._inductor  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means no compiler
        return f"torch._inductor does not import: {e}"
    if device.type == "cpu":
        from torch._inductor import config as inductor_config

        cxx = inductor_config.cpp.cxx
        names = [c for c in (cxx if isinstance(cxx, tuple) else (cxx,)) if c]
        if not any(shutil.which(c) for c in (*names, "g++", "clang++")):
            return "no C++ compiler found for Inductor's CPU code"
    return None


def should_compile(setting: "str | bool", device: torch.device) -> tuple[bool, str]:
    """Whether an engine with ``EngineConfig.compile == setting`` compiles on
    ``device``, and why (for the log)."""
    if setting is False:
        return False, "compile is off"
    why = unavailable(device)
    if why is not None:
        return False, why
    if device.type == "cuda":
        return False, "on CUDA the decode step is captured as CUDA graphs instead (chatkv.cuda_graphs)"
    if setting == "auto" and device.type != "cpu":
        return False, "compile='auto' compiles on the CPU only"
    return True, "compiling"


def _scratch_metadata(pool_kv: torch.Tensor, backend: AttentionBackend, batch: int = 1,
                      tokens: int = 1) -> AttentionMetadata:
    """Metadata for a step of ``batch`` sequences of ``tokens`` new tokens each
    (nothing cached before them: a decode step's shape with ``tokens=1``, a
    fresh prefill's with ``batch=1``) over a scratch pool shaped like
    ``pool_kv`` with just enough blocks for ``tokens``, which every sequence
    writes and reads: what a compile traces and runs, away from the engine's
    pool."""
    layers, _, _, block_size, kv_heads, head_dim = pool_kv.shape
    device = pool_kv.device
    blocks = -(-tokens // block_size)
    kv = torch.zeros((layers, 2, blocks, block_size, kv_heads, head_dim), dtype=pool_kv.dtype, device=device)
    meta = AttentionMetadata(
        kv=kv,
        slot_mapping=torch.arange(tokens, dtype=torch.int64, device=device).repeat(batch),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device).repeat(batch, 1),
        seq_lens=torch.full((batch,), tokens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device) * tokens,
        seq_lens_list=[tokens] * batch,
        query_lens_list=[tokens] * batch,
        max_query_len=tokens,
        backend=backend,
    )
    meta.extras["contiguous_start"] = [0] * batch
    return meta


class DecodeGraphs:
    """The model compiled for decode steps of a few batch sizes.

    Built in any thread but the loop (:meth:`build`), then handed to the
    runner, which calls :meth:`run` on the loop for the steps it covers.
    """

    def __init__(self, model: Any, batch_sizes: tuple[int, ...]) -> None:
        """Prepare to compile ``model`` for decode steps of ``batch_sizes`` sequences."""
        self.model = model
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.ready: frozenset[int] = frozenset()
        self._fn: Callable[..., Any] | None = None

    def build(self, pool_kv: torch.Tensor, backend: AttentionBackend) -> int:
        """Compile a graph per batch size (each traced and run once over a
        scratch pool shaped like ``pool_kv``), in the calling thread, one
        compile at a time in the process; returns how many are ready. Raises
        whatever compiling raises."""
        fn = torch.compile(_step_function(self.model), dynamic=False, options=_compile_options())
        ready = set()
        with _COMPILE_LOCK:
            for b in self.batch_sizes:
                started = time.perf_counter()
                # Inputs made in inference mode, as the runner's are (the graph's
                # guards check their dispatch keys).
                with torch.inference_mode():
                    meta = _scratch_metadata(pool_kv, backend, batch=b)
                    ids = torch.zeros((1, b), dtype=torch.long, device=pool_kv.device)
                    with step_metadata(meta):
                        fn(ids, ids.clone(), 0)
                ready.add(b)
                log.info("compiled the decode step for %d sequence(s) in %.1f s", b, time.perf_counter() - started)
        self._fn = fn
        self.ready = frozenset(ready)
        return len(ready)

    def size_for(self, meta: AttentionMetadata) -> int | None:
        """The compiled batch size this step runs as: a decode step of ``B``
        sequences runs through the graph of the smallest compiled size ``>= B``
        (padded by the caller when larger, as vLLM pads to a captured size);
        None for any other step, or when no size is large enough."""
        if self._fn is None or meta.max_query_len != 1:
            return None
        return min((b for b in self.ready if b >= meta.num_seqs), default=None)

    def run(self, meta: AttentionMetadata, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The step's logits ``[1, B, vocab]`` through the compiled graph (or,
        where its guards fail, the model as it is: never a compile on the loop)."""
        assert self._fn is not None
        with step_metadata(meta), torch.compiler.set_stance(RUN_STANCE):
            out = self._fn(input_ids, position_ids, 0)
        return out.logits


#: Token counts the prefill graph is traced with (see :meth:`PrefillGraph.build`):
#: neither 0 nor 1 (which Dynamo specializes) and unlike any of a model's sizes.
_PREFILL_TRACE_TOKENS = (5, 7)


class PrefillGraph:
    """The model compiled for prefill steps of one sequence, with the number of
    new tokens dynamic: a returning turn's new message, a fresh prompt, a
    chunk of a long one.

    Prefill runs the same ~450 small operators per step as decode, each over
    ``T`` rows; fused, a 21- to 120-token prefill over 1.5k cached tokens runs
    about 1.12x to 1.15x faster here (SmolLM2 in bfloat16, 2 threads;
    attention and the linear layers, opaque operators, are unchanged). One
    graph serves every ``T >= 2``: it is traced with symbolic sizes, so a new
    message length never compiles again. Steps of several sequences, of one
    token, or that keep every token's logits (teacher forcing) run the model
    as it is.
    """

    def __init__(self, model: Any) -> None:
        """Prepare to compile ``model`` for one-sequence prefill steps."""
        self.model = model
        self._fn: Callable[..., Any] | None = None

    def build(self, pool_kv: torch.Tensor, backend: AttentionBackend) -> bool:
        """Compile the graph in the calling thread (one compile at a time in the
        process), traced over a scratch pool shaped like ``pool_kv``, then check
        that a second token count runs through it without compiling again;
        returns True. Raises whatever compiling raises, or
        :class:`RuntimeError` where the graph came out specialized to one
        token count."""
        # Only the token count is symbolic: ``dynamic=True`` would make the model's
        # float attributes (the rotary scaling) symbolic too, which compiles
        # 3x slower and misses AOTAutograd's on-disk cache.
        fn = torch.compile(_step_function(self.model), dynamic=None, options=_compile_options())
        with _COMPILE_LOCK:
            started = time.perf_counter()
            for i, tokens in enumerate(_PREFILL_TRACE_TOKENS):
                with torch.inference_mode():
                    meta = _scratch_metadata(pool_kv, backend, tokens=tokens)
                    ids = torch.zeros((1, tokens), dtype=torch.long, device=pool_kv.device)
                    positions = torch.arange(tokens, dtype=torch.long, device=pool_kv.device).unsqueeze(0)
                    if i == 0:
                        torch._dynamo.mark_dynamic(ids, 1)
                        torch._dynamo.mark_dynamic(positions, 1)
                    stance = "default" if i == 0 else "fail_on_recompile"
                    try:
                        with step_metadata(meta), torch.compiler.set_stance(stance):
                            fn(ids, positions, 1)
                    except RuntimeError as e:
                        if i == 0:
                            raise
                        raise RuntimeError(f"the prefill graph is specialized to {_PREFILL_TRACE_TOKENS[0]} "
                                           f"tokens: {e}") from e
            log.info("compiled the prefill step in %.1f s", time.perf_counter() - started)
        self._fn = fn
        return True

    def covers(self, meta: AttentionMetadata, all_logits: bool) -> bool:
        """Whether the step ``meta`` runs through the graph: one sequence, at
        least two new tokens, only the last token's logits wanted."""
        return self._fn is not None and not all_logits and meta.num_seqs == 1 and meta.max_query_len >= 2

    def run(self, meta: AttentionMetadata, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The logits ``[1, 1, vocab]`` of the step's last token through the
        graph (or, where its guards fail, the model as it is: never a compile
        on the loop)."""
        assert self._fn is not None
        with step_metadata(meta), torch.compiler.set_stance(RUN_STANCE):
            out = self._fn(input_ids, position_ids, 1)
        return out.logits
