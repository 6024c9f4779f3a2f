"""The engine: one loaded model, its block pool, runner, tier policy and loop.

``Engine.generate`` hands a sequence to the engine's scheduler
(:mod:`chatkv.scheduler`), whose loop prefills its uncomputed tokens in chunks
on top of its cached blocks and then decodes it, batched with every other turn
in flight, and streams its text pieces back. That loop is the only code that
touches the pool or runs the model: everything else that needs either (a
session aligning its cache, a restore, the tier policy, the fidelity
calibration) asks it with :meth:`Engine.call`. Sessions are opened through
:attr:`Engine.sessions` (:class:`chatkv.session.SessionManager`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator, TypeVar

import torch

from chatkv import heap
from chatkv.attention import get_backend
from chatkv.attention.torch_backend import products_apply, resolve_cpu_attention, warm_product_buffers
from chatkv.block_pool import BlockPool
from chatkv.block_pool import PoolStats
from chatkv.compile import DecodeGraphs, PrefillGraph, parse_compile, should_compile
from chatkv.config import (
    WARMUP_CONTEXT_TOKENS,
    WARMUP_DECODE_STEPS,
    WARMUP_DELTA_TOKENS,
    WARMUP_HEAD_ROWS,
    WARMUP_LINEAR_ROWS,
    WARMUP_POOL_BYTES,
    WARMUP_PROMPT_TOKENS,
    EngineConfig,
    SamplingParams,
    TierConfig,
)
from chatkv.costs import CostModel, resolve_policy
from chatkv.cuda_graphs import CudaDecodeGraphs, graphs_unavailable
from chatkv.errors import ConfigError, ContextWindowExceededError, EngineClosedError
from chatkv.hardware import parse_dtype, resolve_dtype
from chatkv.models import LoadedModel, encode_chat, load_model
from chatkv.persistence import start_restore_readers
from chatkv.prepack import warm_row_counts
from chatkv.runner import ModelRunner, forwards_in_process
from chatkv.scheduler import Scheduler
from chatkv.sequence import Sequence
from chatkv.stats import TurnStats
from chatkv.tiers import TierManager, TierStats

T = TypeVar("T")

log = logging.getLogger(__name__)

#: How often the compile thread looks again for a loop with no turn to start its compile.
COMPILE_IDLE_POLL_S = 0.2
#: Compiles tried before decode stays uncompiled. A compile fails now and then
#: when the model runs eagerly beside it (a turn that arrived meanwhile):
#: building its guards races with the eager forward through the hub-kernel
#: wrappers transformers puts on layers (the ``kernels`` package's context
#: variable; seen with transformers 5.25 and torch 2.13). Such a failure is
#: tried again when the loop is next idle; one with no forward beside it is not.
COMPILE_ATTEMPTS = 3


def _default_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.6)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return int(min(avail // 4, 2 << 30))


def _eos_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    gen = getattr(loaded.model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), loaded.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids


def _log_warm_up_failure(future: "Future[int]") -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("engine warm-up failed (the first turn pays its first-call costs): %r", future.exception())


class Engine:
    """A model with its paged KV pool, ready to prefill and decode sequences.

    Attributes:
        loaded: the model, tokenizer and fingerprint.
        config: the engine's settings (pool, batching, tier policy).
        pool: the block pool (one per engine), owned by the scheduler's loop.
        runner: the one forward path over the pool (the loop calls it).
        tiers: the memory-tier policy of the engine's sessions (loop-owned).
        scheduler: the loop that batches every turn in flight and runs jobs.
        sessions: the sessions open on this engine (:class:`chatkv.session.SessionManager`).
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        """Size and allocate the block pool for ``loaded`` and attach paged attention
        (and keep freed host memory in the process: :mod:`chatkv.allocator`)."""
        from chatkv.allocator import tune_malloc
        from chatkv.session import SessionManager

        tune_malloc()
        self.loaded = loaded
        self.config = config or EngineConfig()
        if self.config.dtype not in (None, "auto") and parse_dtype(self.config.dtype) != loaded.dtype:
            raise ConfigError(f"EngineConfig(dtype={self.config.dtype!r}) differs from the loaded model's "
                              f"{loaded.dtype}; load it in that dtype (load_model(..., dtype=...)) or "
                              "leave the engine's dtype unset")
        cfg = loaded.model.config
        device = torch.device(self.config.device) if self.config.device else loaded.device
        if device != loaded.device:
            loaded.model.to(device)
        self.device = device
        num_layers = cfg.num_hidden_layers
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = loaded.dtype
        per_block = BlockPool.bytes_per_block_for(num_layers, kv_heads, head_dim, self.config.block_size, dtype)
        num_blocks = self.config.num_blocks or max(
            1, (self.config.kv_budget_bytes or _default_budget(device)) // per_block
        )
        self.pool = BlockPool(num_blocks, self.config.block_size, num_layers, kv_heads, head_dim,
                              dtype, device, loaded.fingerprint)
        self.backend = get_backend(self.config.attention_backend, device,
                                   resolve_cpu_attention(self.config.cpu_attention))
        #: Measured prefill and disk-restore costs: restore or recompute (:mod:`chatkv.costs`).
        self.costs = CostModel(resolve_policy(self.config.restore_policy), self.config.max_prefill_tokens)
        self.runner = ModelRunner(loaded.model, self.pool, self.backend, self.costs, prepack=self.config.prepack)
        self.eos_ids = _eos_ids(loaded)
        self.tiers = TierManager(self, self.config.tiers)
        self.scheduler = Scheduler(self)
        self.sessions = SessionManager(self)
        #: The background warm-up (``EngineConfig.warmup``): its result is the tokens it ran; None if off.
        self.warmed: Future[int] | None = None
        if self.config.warmup:
            self.warmed = self.scheduler.submit_job(self._warm_up, "warm-up")
            self.warmed.add_done_callback(_log_warm_up_failure)
        #: The background compile of the decode step and then the prefill step
        #: (``EngineConfig.compile``; on CUDA, the capture of the decode step's
        #: CUDA graphs), done when both are: its result is how many decode batch
        #: sizes got a graph (0: none, and the log says why).
        self.compiled: Future[int] = Future()
        setting = parse_compile(self.config.compile)
        if device.type == "cuda":
            why = "compile is off" if setting is False else graphs_unavailable(device, self.backend)
            if why is None:
                job = self.scheduler.submit_job(self._capture_graphs, "capture CUDA graphs")
                job.add_done_callback(lambda f: self.compiled.set_result(
                    0 if f.cancelled() or f.exception() is not None else f.result()))
            else:
                log.info("decode steps are not captured as CUDA graphs: %s", why)
                self.compiled.set_result(0)
        else:
            enabled, why = should_compile(setting, device)
            if enabled:
                threading.Thread(target=self._compile, name="chatkv-compile", daemon=True).start()
            else:
                log.debug("the decode step is not compiled: %s", why)
                self.compiled.set_result(0)
        # Once warmed up and compiled, the rehearsal of a returning turn runs
        # (SessionManager.rehearse), then the heap made so far stays out of the
        # garbage collector's walks until close (chatkv.heap).
        self._heap_lock = threading.Lock()
        self._heap_frozen = self._heap_closed = self._settling = False
        self._heap_settled = threading.Event()  # rehearsed and frozen, or left alone
        #: The rehearsal after the warm-up (:meth:`chatkv.session.SessionManager.rehearse`):
        #: its result is the returning turns it ran; None if warm-up is off.
        self.rehearsed: Future[int] | None = None
        if self.warmed is not None:
            self.rehearsed = Future()
            startup = [self.warmed, self.compiled]
            for job in startup:
                job.add_done_callback(lambda _: all(f.done() for f in startup) and self._settle())
        else:
            self._heap_settled.set()

    def _settle(self) -> None:
        """Once the warm-up and the compile are done: in a thread of its own,
        the rehearsal of a returning conversation's turn
        (:meth:`chatkv.session.SessionManager.rehearse`), then the heap frozen
        (:meth:`_freeze_heap`). Once."""
        with self._heap_lock:
            if self._settling:
                return
            self._settling = True

        def run() -> None:
            turns = 0
            try:
                turns = self.sessions.rehearse()
            finally:
                self.rehearsed.set_result(turns)  # type: ignore[union-attr]
                self._freeze_heap()

        threading.Thread(target=run, name="chatkv-rehearsal", daemon=True).start()

    def _freeze_heap(self) -> None:
        """After the warm-up and the compile: freeze the heap made so far
        (:func:`chatkv.heap.freeze`), once, unless the engine is closing."""
        try:
            with self._heap_lock:
                if not self._heap_closed and not self._heap_frozen:
                    self._heap_frozen = heap.freeze()
        finally:
            self._heap_settled.set()

    def wait_warm(self, timeout: float | None = None) -> int:
        """Block until the background warm-up, the decode step's compile and
        the rehearsal of a returning turn have finished (and the heap they
        leave is frozen, :mod:`chatkv.heap`), so that what follows is timed
        without them; returns the tokens the warm-up ran (0 when warm-up is off).

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            Exception: whatever the warm-up raised (a failed compile is logged, not raised).
        """
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        n = 0 if self.warmed is None else self.warmed.result(timeout=timeout)
        self.compiled.result(timeout=left())
        if not self._heap_settled.wait(left()):  # the heap frozen after both (chatkv.heap)
            raise TimeoutError("the engine's warm-up has not finished")
        return n

    def _compile(self) -> None:
        """The compile thread: after the warm-up, compile the decode step and
        then (``EngineConfig.compile_prefill``) the one-sequence prefill step
        (:mod:`chatkv.compile`) away from the loop, handing each to the runner
        with a loop job as soon as it is ready. Its OpenMP pool goes when it
        ends. A failure while the model ran beside it is tried again
        (:data:`COMPILE_ATTEMPTS`); a last failure is logged and those steps
        run uncompiled (the prefill is not tried where the decode step failed).
        :attr:`compiled` always completes, after both."""
        n = 0
        try:
            if self.warmed is not None:
                try:
                    self.warmed.result()
                except Exception:  # noqa: BLE001 - logged by _log_warm_up_failure; compile anyway
                    pass
            graphs = DecodeGraphs(self.runner.model, self.config.compile_batch_sizes)
            n = self._compile_and_install("the decode step", lambda: graphs.build(self.pool.kv, self.backend),
                                          lambda: setattr(self.runner, "decode_graphs", graphs)) or 0
            if n and self.config.compile_prefill:
                prefill = PrefillGraph(self.runner.model)
                self._compile_and_install("the prefill step", lambda: prefill.build(self.pool.kv, self.backend),
                                          lambda: self._install_prefill(prefill))
        except EngineClosedError:
            n = 0
        finally:
            self.compiled.set_result(n)

    def _install_prefill(self, prefill: PrefillGraph) -> None:
        """Hand ``prefill`` to the runner (on the loop) and run the warm-up's
        throwaway returning turn once more, through it, so that a session's
        first turn does not pay the graph's first run at that shape."""
        self.runner.prefill_graph = prefill
        self._warm_up_return(decode_steps=1)
        self._warm_product_buffers()  # again: the graph's first run took some of what the warm-up's freed

    def _warm_product_buffers(self) -> None:
        """On the loop, where attention runs by products: their largest buffers
        once (:func:`chatkv.attention.torch_backend.warm_product_buffers`), so
        that the freed memory stays with the loop's and its workers' allocators
        for a long prefill's attention. Without it, the first 250-token turn
        over 3.6k tokens of a fresh process faulted in about 20,000 fresh
        pages and took 0.41 to 0.49 s against 0.34 to 0.45 s for the next turn;
        with it, 42 to 8,000 pages and 0.34 to 0.40 s (``/tmp`` probe, three
        fresh processes). The memory kept is about 24 MB (100 MB before a
        long prefill's softmax went by tiles)."""
        kv = self.pool.kv  # [layers, 2, blocks, block size, KV heads, head dim]
        heads = getattr(self.runner.model.config, "num_attention_heads", None)
        if heads and getattr(self.backend, "products", False) and products_apply(kv[0, 0, 0]):
            warm_product_buffers(kv.shape[-2], heads // kv.shape[-2], kv.shape[-1], kv.device)

    def _compile_and_install(self, what: str, build: Callable[[], T], install: Callable[[], None]) -> "T | None":
        """Compile ``what`` with ``build`` (:meth:`_compile_when_idle`), then run
        ``install`` on the loop; returns what ``build`` returned, or None where
        it failed (logged: those steps run uncompiled) or the engine closed."""
        try:
            result = self._compile_when_idle(what, build)
        except EngineClosedError:
            raise
        except Exception:  # noqa: BLE001 - the engine runs those steps uncompiled; say why
            log.warning("compiling %s failed; it runs uncompiled", what, exc_info=True)
            return None
        if result is None:
            return None
        self.scheduler.submit_job(install, f"install compiled {what}").result()
        return result

    def _compile_when_idle(self, what: str, build: Callable[[], T]) -> "T | None":
        """Run ``build`` (a compile) in this thread once the engine is idle,
        up to :data:`COMPILE_ATTEMPTS` times where it fails while a model ran
        beside it (this engine's or another's in the process:
        :func:`chatkv.runner.forwards_in_process`); returns its result, or
        None when the engine closed first. Raises the last failure."""
        for attempt in range(1, COMPILE_ATTEMPTS + 1):
            # Dynamo holds the GIL for most of a compile, and a turn's steps beside
            # it ran about 4x slower: start between turns (a turn that arrives
            # during the compile still shares the process with it).
            while not self.scheduler.closed and not self.call(self.scheduler.idle, "idle?"):
                time.sleep(COMPILE_IDLE_POLL_S)
            if self.scheduler.closed:
                return None
            started = time.perf_counter()
            forwards = forwards_in_process()  # this engine's steps or another's: both race with the trace
            try:
                result = build()
            except Exception:
                if forwards_in_process() == forwards or attempt == COMPILE_ATTEMPTS:
                    raise
                log.warning("compiling %s failed while the model ran beside it (attempt %d of %d); trying "
                            "again when the engine is idle", what, attempt, COMPILE_ATTEMPTS, exc_info=True)
                continue
            log.info("%s compiled in %.1f s", what, time.perf_counter() - started)
            return result
        return None

    def _capture_graphs(self) -> int:
        """The capture job (on the loop, after the warm-up): the decode step
        as a CUDA graph per size of ``EngineConfig.compile_batch_sizes``
        (:mod:`chatkv.cuda_graphs`), installed in the runner. Returns how many
        sizes were captured; 0, with the reason in the log, where capture
        failed or the pool had no block for the pad rows."""
        pad = self.runner.pad_slot()
        if pad is None:
            log.warning("decode steps are not captured as CUDA graphs: the pool has no free block for pad rows")
            return 0
        started = time.perf_counter()
        graphs = CudaDecodeGraphs(self.runner.model, self.config.compile_batch_sizes,
                                  self.max_context, self.pool.block_size)
        try:
            n = graphs.capture(self.pool.kv, self.backend, *pad)
        except Exception:  # noqa: BLE001 - decode runs as it is; say why
            log.warning("capturing the decode step as CUDA graphs failed; decode runs as it is", exc_info=True)
            return 0
        self.runner.decode_graphs = graphs
        log.info("decode step captured as CUDA graphs for %d batch size(s) in %.2f s",
                 n, time.perf_counter() - started)
        return n

    def _warm_up(self) -> int:
        """The warm-up job (on the loop): the chat template and the text bound
        once, the pool's first pages, the restore reader threads, a throwaway
        new turn and a throwaway returning one, then the packed linears'
        kernels for short steps of every length and, where attention runs by
        products, their largest buffers (:meth:`_warm_product_buffers`)."""
        from chatkv.models import max_token_chars

        started = time.perf_counter()
        self.encode_chat([{"role": "system", "content": "warm-up"}, {"role": "user", "content": "hello"}])
        max_token_chars(self.tokenizer)
        self.pool.commit_pages(WARMUP_POOL_BYTES)
        start_restore_readers()
        prompt = min(WARMUP_PROMPT_TOKENS, self.max_context - WARMUP_DECODE_STEPS - 1)
        n = self.runner.warm_up(prompt, WARMUP_DECODE_STEPS, self.config.max_prefill_tokens)
        n += self._warm_up_return(WARMUP_DECODE_STEPS, used=n)
        warm_row_counts(self.runner.model, range(1, WARMUP_LINEAR_ROWS + 1), WARMUP_HEAD_ROWS)
        self._warm_product_buffers()
        log.debug("engine warm-up: %d tokens in %.3f s", n, time.perf_counter() - started)
        return n

    def _warm_up_return(self, decode_steps: int, used: int = 0) -> int:
        """On the loop: the warm-up's throwaway returning turn
        (:meth:`ModelRunner.warm_up_return`: :data:`WARMUP_DELTA_TOKENS` over up
        to :data:`WARMUP_CONTEXT_TOKENS` of history, then ``decode_steps``),
        its history shortened so that it and ``used`` tokens fit the window.
        Returns the tokens run."""
        room = self.max_context - used - WARMUP_DELTA_TOKENS - decode_steps - 1
        return self.runner.warm_up_return(min(WARMUP_CONTEXT_TOKENS, room), WARMUP_DELTA_TOKENS, decode_steps)

    def close(self, timeout: float | None = 60.0) -> None:
        """Close the engine: close every session still open on it (each saved
        and its lease released, as :meth:`chatkv.Chat.close` does), stop its
        maintenance thread, and end its loop thread now instead of once idle
        (:data:`chatkv.scheduler.IDLE_EXIT_S` beside another engine's loop,
        :data:`~chatkv.scheduler.LONE_IDLE_EXIT_S` alone). Each loop thread that ran
        the model holds an OpenMP thread pool: a process that makes engines
        one after another should close each, or their pools outnumber the
        cores and every operator slows down. Afterwards turns, jobs and new
        sessions raise :class:`~chatkv.errors.EngineClosedError`. Idempotent.
        """
        if self.scheduler.closed:
            return
        with self._heap_lock:
            self._heap_closed = True
            if self._heap_frozen:
                heap.release()
                self._heap_frozen = False
        self.sessions.close_all()
        self.sessions.stop_maintenance()
        with _ENGINES_LOCK:
            for key in [k for k, e in _ENGINES.items() if e is self]:
                del _ENGINES[key]
        if not self.scheduler.close(timeout):
            log.warning("the engine's loop did not end within %s s of close()", timeout)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.loaded.tokenizer

    @property
    def max_context(self) -> int:
        """The longest sequence a turn may reach: the model's window, or
        ``EngineConfig.max_context`` if that is smaller."""
        cap = self.config.max_context
        return self.loaded.max_context if cap is None else min(cap, self.loaded.max_context)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` under the model's chat template: the ids a
        session's KV must cover (see :func:`chatkv.models.encode_chat`)."""
        return encode_chat(self.tokenizer, messages, add_generation_prompt)

    # -- the loop --------------------------------------------------------------------

    def call(self, fn: Callable[[], T], name: str = "job") -> T:
        """Run ``fn`` on the engine's loop, between two forward steps, and return
        its result (re-raising its exception). The way any code outside the loop
        reads or changes the pool, the tier policy or a session's KV."""
        return self.scheduler.run(fn, name)

    def pool_stats(self) -> PoolStats:
        """The pool's occupancy and counters, read on the loop."""
        return self.call(self.pool.stats, "pool stats")

    def tier_stats(self) -> TierStats:
        """Where the KV of this engine's sessions lives now, read on the loop."""
        return self.call(self.tiers.stats, "tier stats")

    def configure_tiers(self, config: TierConfig | dict[str, Any]) -> None:
        """Put a new tier policy (budgets, idle times, quantization scheme) in force
        for every session of this engine, and fit the budgets at once."""
        if isinstance(config, dict):
            config = TierConfig.from_dict(config)

        def apply() -> None:
            self.tiers.configure(config)
            self.tiers.enforce_budgets()

        self.call(apply, "configure tiers")
        self.sessions.start_maintenance()

    # -- turns -----------------------------------------------------------------------

    def check_context(self, n_tokens: int, *, generate: bool = True, what: str = "the sequence") -> None:
        """Raise :class:`ContextWindowExceededError` unless ``n_tokens`` fit the
        model's window (with room for one generated token when ``generate``)."""
        limit = self.max_context - 1 if generate else self.max_context
        if n_tokens > limit:
            extra = " Start a new session or reset this one." if generate else ""
            raise ContextWindowExceededError(
                f"{what} is {n_tokens} tokens; the model's context window is {self.max_context}.{extra}")

    def prefill(self, seq: Sequence, stats: TurnStats | None = None) -> int:
        """Compute the KV of every token of ``seq`` past ``num_computed`` (the last
        one included) through the scheduler, batched with other turns; returns
        how many tokens were computed. ``seq`` belongs to the loop meanwhile.

        Raises:
            ContextWindowExceededError: ``seq`` is longer than the model's window.
            OutOfBlocksError, QueueFullError: as :meth:`generate`.
        """
        stats = stats if stats is not None else TurnStats()
        self.check_context(len(seq.token_ids), generate=False)
        todo = len(seq.token_ids) - seq.num_computed
        if todo <= 0:
            return 0
        request = self.scheduler.submit(seq, SamplingParams(), stats, prefill_only=True)
        for _ in self.scheduler.stream(request):
            pass
        return todo

    def generate(self, seq: Sequence, params: SamplingParams, stats: TurnStats | None = None
                 ) -> Iterator[str]:
        """Prefill ``seq``'s uncomputed tokens, then decode, yielding text pieces.

        The turn is queued to :attr:`scheduler`, which runs it batched with every
        other turn in flight; this generator yields the pieces it produces, in
        the caller's thread. Sampled tokens are appended to ``seq.token_ids``;
        the last one (EOS or the final token) is left uncomputed. ``seq`` belongs
        to the loop until the generator ends: the caller must not touch it
        meanwhile. ``stats`` (if given) is complete when the generator ends,
        including when the consumer stops early (``close()``, garbage
        collection) or is interrupted (``KeyboardInterrupt``): the turn is then
        cancelled at the next step and ``finish_reason`` is ``"interrupted"``,
        with exactly the pieces the consumer took kept (tokens the engine ran
        ahead with are dropped, their KV too).

        Raises:
            ContextWindowExceededError: the prompt alone leaves no room to generate.
            QueueFullError: ``config.max_waiting`` turns are already waiting to start.
            OutOfBlocksError: the turn cannot fit in the pool even with every
                other turn in flight preempted.
        """
        stats = stats if stats is not None else TurnStats()
        self.check_context(len(seq.token_ids), what="the conversation")
        request = self.scheduler.submit(seq, params, stats)
        yield from self.scheduler.stream(request)


_ENGINES: dict[tuple, Engine] = {}
_ENGINES_LOCK = threading.Lock()


def get_engine(model: str | LoadedModel | None = None, config: EngineConfig | None = None) -> Engine:
    """The process-wide engine for a model spec (loaded on first use, then shared).

    ``model`` is a spec for :func:`chatkv.models.load_model` or an already
    loaded model. Engines are keyed by the spec (or object) and config, so every
    ``Chat`` on the same model shares one pool and its prefix cache. A spec is
    loaded in ``config.dtype`` (see :func:`chatkv.hardware.resolve_dtype`:
    bfloat16 on hardware that computes it natively, else float32).
    """
    key = (id(model) if isinstance(model, LoadedModel) else (model or "default"), repr(config))
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            if isinstance(model, LoadedModel):
                loaded = model
            else:
                cfg = config or EngineConfig()
                device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
                loaded = load_model(model, dtype=resolve_dtype(cfg.dtype, device))
            engine = Engine(loaded, config)
            _ENGINES[key] = engine
        return engine


def engine_for(model: Any, engine: Engine | None, config: EngineConfig | None,
                tiers: TierConfig | None, kv_quant: str | None) -> Engine:
    """The engine a ``Chat`` runs on: ``engine``, or the shared one for ``model``
    and ``config``. Tier policy given to a ``Chat`` (``tiers``, ``kv_quant``) is
    engine-wide, so it selects an engine with that policy.

    Raises:
        ConfigError: the policy conflicts with an explicit ``engine``'s own.
    """
    if tiers is None and kv_quant is None:
        return engine or get_engine(model, config)
    base = engine.config if engine is not None else (config or EngineConfig())
    current = engine.tiers.config if engine is not None else (base.tiers or TierConfig())
    wanted = tiers or current
    if kv_quant is not None:
        wanted = wanted.replace(quant_scheme=kv_quant)
    if engine is None:
        return get_engine(model, dataclasses.replace(base, tiers=wanted))
    if engine.tiers.config != wanted:
        raise ConfigError("tier policy is engine-wide: set it with engine.configure_tiers(...) or "
                          "EngineConfig(tiers=...), not per Chat on an existing engine")
    return engine
