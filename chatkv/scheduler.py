"""The scheduler: continuous batching of every in-flight turn of one engine.

One background thread, the *step loop*, owns every in-flight request. Each step:

1. drops cancelled requests (their consumer stopped iterating);
2. plans the step: one decode token for every running request, then chunks of
   unfinished prefills, then new or requeued requests admitted in arrival
   order, all within a token budget (``EngineConfig.max_prefill_tokens``) and
   the pool's free blocks;
3. runs ONE packed ``runner.forward`` over the plan, under ``engine.lock``;
4. samples each sequence that reached its end with its own sampler, detokenizes
   and pushes the text pieces to the request's channel, which the consumer
   drains from its own thread (:meth:`Engine.generate`) or event loop
   (:mod:`chatkv.aio`).

Memory pressure is met in this order: evictable cached blocks (the pool does
that), then ``engine.reclaimer`` (a hook the tier manager may bind to demote
idle sessions), then *preemption* of the lowest-priority in-flight request,
the latest to arrive: its blocks go back to the pool, last block first, so
its full blocks stay in the prefix cache and only the ones actually reused
are lost; it is requeued, and on re-admission revives whatever is still
cached and recomputes the rest. Its sampled tokens are kept, so greedy output
does not change. A request that cannot fit even with every other in-flight
request preempted waits ``EngineConfig.block_wait_s`` for blocks (a session
closing, the tier manager demoting one) and then gets
:class:`~chatkv.errors.OutOfBlocksError`; one that needs more blocks than the
pool has gets it at once.

Output travels through :mod:`chatkv.channel`. Ownership: a request's sequence, result, sampler and streamer are touched only
by the step loop from submission until its ``done`` event is set; the
consumer reads them afterwards. Pool mutations happen under ``engine.lock``.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from chatkv.channel import (
    EMPTY,
    END,
    NONBLOCKING,
    Channel,
    Failure,
    Pending,
    next_nonblocking,
)
from chatkv.config import SamplingParams
from chatkv.detokenizer import TextStreamer
from chatkv.errors import OutOfBlocksError, QueueFullError
from chatkv.runner import StepInput
from chatkv.sampling import Sampler
from chatkv.sequence import Sequence

__all__ = ["Pending", "Request", "Scheduler", "SchedulerStats", "next_nonblocking"]

if TYPE_CHECKING:
    from chatkv.block_pool import BlockPool
    from chatkv.engine import Engine, GenerationResult

#: The step loop exits after this long with nothing to do (and restarts on the next turn),
#: so an engine nobody uses holds no thread.
IDLE_EXIT_S = 2.0
#: How long the loop sleeps when no request can make progress (all blocked on blocks).
_STALL_WAIT_S = 0.01
#: How often a blocked consumer checks that the step loop is still alive.
_POLL_S = 0.5
#: The reclaimer is not called more often than this while pressure lasts.
_RECLAIM_INTERVAL_S = 0.05

# ------------------------------------------------------------------------------ requests


@dataclass(eq=False)
class Request:
    """One turn in flight: a sequence to extend, how to sample, where the output goes."""

    seq: Sequence
    params: SamplingParams
    result: GenerationResult
    sampler: Sampler
    streamer: TextStreamer
    arrival: int
    submitted: float
    channel: Channel = field(default_factory=Channel)
    done: threading.Event = field(default_factory=threading.Event)
    admitted: bool = False  # admitted at least once (no longer counts against max_waiting)
    preempted: bool = False  # released by preemption; revive cached blocks on re-admission
    blocked_since: float | None = None
    decode_start: float | None = None
    # Written by the consumer as it takes pieces: how much of the reply it has seen.
    delivered_tokens: int = 0
    delivered_text: str = ""

    @property
    def todo(self) -> int:
        """Tokens of the sequence not yet computed (1 while decoding)."""
        return len(self.seq.token_ids) - self.seq.num_computed


@dataclass
class SchedulerStats:
    """Counters of one engine's scheduler since it was made."""

    steps: int = 0
    forward_tokens: int = 0
    max_batch_seqs: int = 0
    max_batch_tokens: int = 0
    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    preemptions: int = 0
    rejected: int = 0


@dataclass
class _StepPlan:
    """A step being planned: what runs, the blocks it reserves, the prefill tokens left."""

    budget: int
    may_reclaim: bool
    now: float
    items: list[tuple[Request, int]] = field(default_factory=list)
    reserved: int = 0

    def add(self, req: Request, n: int, need: int) -> None:
        self.items.append((req, n))
        self.reserved += need
        if req.todo > 1:  # decode tokens were set aside before the budget was counted
            self.budget -= n


class _NeedBlocks(Exception):
    """Raised by planning when blocks are short and the reclaimer may help."""

    def __init__(self, wanted: int) -> None:
        super().__init__(wanted)
        self.wanted = wanted


def pool_ok(engine: Engine, plan: list[tuple[Request, int]]) -> bool:
    """Whether the pool can hold every write of ``plan`` (checked before each forward)."""
    pool = engine.pool
    return sum(pool.blocks_needed(r.seq, n) for r, n in plan) <= pool.num_available


def release_tail_first(pool: BlockPool, seq: Sequence) -> None:
    """Release every block of ``seq`` last block first, keeping ``seq.token_ids``.

    The pool evicts cached blocks least recently released first, so releasing
    the tail first means the blocks a later prefix match needs first (the head)
    are the last to be evicted.
    """
    ids = list(seq.token_ids)
    bs = pool.block_size
    for k in range(len(seq.block_table) - 1, -1, -1):
        pool.truncate(seq, min(k * bs, seq.num_computed))
    seq.token_ids = ids


def revive_prefix(pool: BlockPool, seq: Sequence) -> int:
    """Attach the cached blocks that still hold a prefix of an emptied ``seq``'s
    tokens (at most all but the last token); returns how many tokens they cover."""
    ids = list(seq.token_ids)
    matched = pool.match_prefix(seq, ids)
    seq.token_ids = ids
    return matched


# ------------------------------------------------------------------------------ scheduler


class Scheduler:
    """Batches every in-flight turn of one engine into shared forward passes.

    Thread-safe: :meth:`submit`, :meth:`stream` and :meth:`cancel` may be called
    from any thread. The step loop thread starts on the first submission and
    exits after :data:`IDLE_EXIT_S` without work.
    """

    def __init__(self, engine: Engine) -> None:
        """A scheduler for ``engine`` (no thread is started yet)."""
        self.engine = engine
        self.stats = SchedulerStats()
        self._mu = threading.Lock()
        self._wake = threading.Condition(self._mu)
        self._incoming: list[Request] = []
        self._cancels: list[Request] = []
        self._unadmitted = 0  # submitted, not yet admitted nor finished (bounded by max_waiting)
        self._thread: threading.Thread | None = None
        self._arrivals = itertools.count()
        # Owned by the step loop thread:
        self._waiting: list[Request] = []  # sorted by arrival
        self._running: list[Request] = []  # sorted by arrival
        self._last_reclaim = 0.0

    # -- the consumer's side ------------------------------------------------------------

    def submit(self, seq: Sequence, params: SamplingParams, result: GenerationResult) -> Request:
        """Queue a turn that extends ``seq``; the step loop takes it from here.

        Raises:
            QueueFullError: ``max_waiting`` turns are already waiting to start.
            ValueError: ``seq`` has no uncomputed token to start from.
        """
        engine = self.engine
        if len(seq.token_ids) <= seq.num_computed:
            raise ValueError("nothing to generate from: the last token of the sequence must be uncomputed")
        cap = engine.config.max_waiting
        with self._mu:
            if self._unadmitted >= cap:
                self.stats.rejected += 1
                raise QueueFullError(
                    f"{self._unadmitted} turns are already waiting to start (max_waiting={cap}); "
                    "retry later or raise EngineConfig.max_waiting"
                )
            req = Request(seq, params, result, Sampler(params), TextStreamer(engine.tokenizer, params.stop),
                          arrival=next(self._arrivals), submitted=time.perf_counter())
            result.finish_reason = "interrupted"  # until it ends otherwise
            result.prefilled_tokens = len(seq.token_ids) - seq.num_computed
            self._unadmitted += 1
            self.stats.submitted += 1
            self._incoming.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="chatkv-scheduler", daemon=True)
                self._thread.start()
            self._wake.notify()
        return req

    def stream(self, req: Request) -> Iterator[Any]:
        """Yield ``req``'s text pieces as the step loop produces them.

        Returns when the generation ends; re-raises the exception it failed
        with. Closing the iterator early (or an exception in the consumer, such
        as ``KeyboardInterrupt``) cancels the request and waits until the step
        loop has let go of it. In non-blocking mode (:func:`next_nonblocking`)
        a :class:`Pending` is yielded instead of waiting.
        """
        finished = False
        announced = False
        try:
            while True:
                if NONBLOCKING.get():
                    item = req.channel.peek()
                    if item is EMPTY:
                        yield Pending(req.channel, final=False)
                        continue
                    if (item is END or isinstance(item, Failure)) and not announced:
                        announced = True
                        yield Pending(req.channel, final=True)
                        continue
                    req.channel.pop()
                else:
                    item = req.channel.get(_POLL_S)
                    if item is EMPTY:
                        self._check_alive(req)
                        continue
                if item is END:
                    finished = True
                    return
                if isinstance(item, Failure):
                    finished = True
                    raise item.exc
                text, req.delivered_tokens = item
                req.delivered_text += text
                yield text
        finally:
            if not finished:
                self.cancel(req)
                self._trim_to_delivered(req)

    def cancel(self, req: Request) -> None:
        """Stop ``req`` at the next step (its partial output is kept, ``finish_reason``
        is ``"interrupted"``) and wait until the step loop has let go of it."""
        if req.done.is_set():
            return
        with self._mu:
            self._cancels.append(req)
            self._wake.notify()
        while not req.done.wait(_POLL_S):
            self._check_alive(req)

    def _trim_to_delivered(self, req: Request) -> None:
        """After a cancellation, keep only the part of the reply the consumer took:
        the step loop may have run a few tokens ahead of it, and the history must
        hold what the user saw. Their KV is truncated away too."""
        result, seq = req.result, req.seq
        extra = len(result.token_ids) - req.delivered_tokens
        if extra <= 0:
            return
        keep = len(seq.token_ids) - extra
        with self.engine.lock:
            ids = seq.token_ids[:keep]
            if seq.num_computed > keep:
                self.engine.pool.truncate(seq, keep)
            seq.token_ids = ids
        del result.token_ids[req.delivered_tokens :]
        result.text = req.delivered_text
        result.finish_reason = "interrupted"

    def _check_alive(self, req: Request) -> None:
        with self._mu:
            alive = self._thread is not None and self._thread.is_alive()
        if not alive and not req.done.is_set():
            raise RuntimeError("the chatkv scheduler thread stopped with a turn in flight")

    @property
    def num_waiting(self) -> int:
        """Turns submitted and not yet started."""
        with self._mu:
            return self._unadmitted

    # -- the step loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._mu:
                while not (self._incoming or self._cancels or self._waiting or self._running):
                    if not self._wake.wait(IDLE_EXIT_S) and not (self._incoming or self._cancels):
                        self._thread = None
                        return
                for req in self._incoming:
                    bisect.insort(self._waiting, req, key=lambda r: r.arrival)
                self._incoming.clear()
                cancels, self._cancels = self._cancels, []
            try:
                progressed = self._step(cancels)
            except BaseException as exc:  # never leave a consumer waiting on a dead loop
                for req in self._waiting + self._running:
                    self._fail(req, exc)
                progressed = True
            if not progressed:
                with self._mu:
                    if not (self._incoming or self._cancels):
                        self._wake.wait(_STALL_WAIT_S)

    def _step(self, cancels: list[Request]) -> bool:
        """One step; returns False if nothing could run (every request is blocked)."""
        engine = self.engine
        plan: list[tuple[Request, int]] = []
        may_reclaim = engine.reclaimer is not None
        while True:
            with engine.lock:
                for req in cancels:
                    self._drop(req)
                cancels = []
                try:
                    plan = self._plan(may_reclaim)
                except _NeedBlocks as need:
                    wanted = need.wanted
                else:
                    if not plan:
                        return False
                    try:
                        assert pool_ok(engine, plan), "the plan reserves more blocks than the pool has"
                        batch = [StepInput(r.seq, r.seq.token_ids[r.seq.num_computed : r.seq.num_computed + n])
                                 for r, n in plan]
                        logits = engine.runner.forward(batch)
                    except BaseException as exc:
                        for req, _ in plan:
                            self._fail(req, exc)
                        return True
                    break
            # The reclaimer (the tier manager) takes its own locks, then engine.lock:
            # call it without engine.lock to keep one lock order.
            may_reclaim = False
            self._last_reclaim = time.monotonic()
            try:
                engine.reclaimer(wanted)  # type: ignore[misc]
            except Exception:
                pass  # reclaiming is best effort; preemption follows
        stats = self.stats
        stats.steps += 1
        tokens = sum(n for _, n in plan)
        stats.forward_tokens += tokens
        stats.max_batch_seqs = max(stats.max_batch_seqs, len(plan))
        stats.max_batch_tokens = max(stats.max_batch_tokens, tokens)
        self._sample(plan, logits)
        return True

    # -- planning (under engine.lock) ----------------------------------------------------------

    def _plan(self, may_reclaim: bool) -> list[tuple[Request, int]]:
        """Choose this step's ``(request, token count)`` pairs, preempting under pressure.

        Raises:
            _NeedBlocks: blocks are short and the reclaimer may be called first.
        """
        cfg = self.engine.config
        step = _StepPlan(
            budget=max(0, cfg.max_prefill_tokens - sum(1 for r in self._running if r.todo == 1)),
            may_reclaim=may_reclaim and time.monotonic() - self._last_reclaim >= _RECLAIM_INTERVAL_S,
            now=time.monotonic(),
        )
        self._plan_running(step)
        self._plan_admissions(step)
        return step.items

    def _short(self, step: _StepPlan, need: int) -> bool:
        return need > self.engine.pool.num_available - step.reserved

    def _plan_running(self, step: _StepPlan) -> None:
        """Every running request's next tokens: its decode token, or a prefill chunk
        within the budget. A request short of blocks preempts later arrivals."""
        pool, running = self.engine.pool, self._running
        i = 0
        while i < len(running):
            req = running[i]
            n = 1 if req.todo == 1 else min(req.todo, step.budget)
            if n == 0:
                i += 1
                continue
            if self._never_fits(req, n):
                continue
            need = pool.blocks_needed(req.seq, n)
            while self._short(step, need):
                if step.may_reclaim:
                    raise _NeedBlocks(step.reserved + need)
                victim = self._victim(req)
                if victim is None:
                    break
                self._preempt(victim)
            if self._short(step, need):
                if self._others_hold_blocks(req):
                    self._preempt(req)  # a higher-priority request holds what it needs: wait behind it
                else:
                    self._blocked(req, step.now)
                    i += 1
                continue
            req.blocked_since = None
            step.add(req, n, need)
            i += 1

    def _plan_admissions(self, step: _StepPlan) -> None:
        """Start waiting requests in arrival order while the budget and the pool
        allow; these never preempt running ones."""
        pool, cfg = self.engine.pool, self.engine.config
        waiting, running = self._waiting, self._running
        while waiting and step.budget > 0 and len(running) < cfg.max_num_seqs:
            req = waiting[0]
            revived = req.preempted
            if revived:
                revive_prefix(pool, req.seq)  # takes blocks: undone below if it cannot start
            n = min(req.todo, step.budget)
            if self._never_fits(req, n):
                continue
            need = pool.blocks_needed(req.seq, n)
            if self._short(step, need) and step.may_reclaim:
                if revived:
                    release_tail_first(pool, req.seq)
                raise _NeedBlocks(step.reserved + need)
            if self._short(step, need) and not running:
                # Nothing runs, so nothing else will make room: release lower-priority waiting requests.
                while self._short(step, need) and (victim := self._victim(req)) is not None:
                    self._preempt(victim)
            if self._short(step, need):
                if revived:
                    release_tail_first(pool, req.seq)
                if not running and not self._others_hold_blocks(req):
                    self._blocked(req, step.now)
                return
            if revived:
                req.preempted = False
                req.result.recomputed_tokens += req.todo
            req.blocked_since = None
            waiting.pop(0)
            bisect.insort(running, req, key=lambda r: r.arrival)
            if not req.admitted:
                req.admitted = True
                with self._mu:
                    self._unadmitted -= 1
            step.add(req, n, need)

    def _never_fits(self, req: Request, n: int) -> bool:
        """Fail ``req`` (and return True) if its next ``n`` tokens need more blocks than the pool has."""
        pool = self.engine.pool
        total = -(-(req.seq.num_computed + n) // pool.block_size)
        if total <= pool.num_blocks:
            return False
        self._fail(req, OutOfBlocksError(
            f"the conversation needs {total} blocks of {pool.block_size} tokens but the KV pool has only "
            f"{pool.num_blocks}; raise kv_budget_bytes or num_blocks"))
        return True

    def _victim(self, req: Request) -> Request | None:
        """The latest-arrived in-flight request after ``req`` that holds blocks."""
        best: Request | None = None
        for other in itertools.chain(self._running, self._waiting):
            if other.arrival > req.arrival and other.seq.block_table and (best is None or other.arrival > best.arrival):
                best = other
        return best

    def _others_hold_blocks(self, req: Request) -> bool:
        return any(o is not req and o.seq.block_table for o in itertools.chain(self._running, self._waiting))

    def _preempt(self, req: Request) -> None:
        """Release ``req``'s blocks to the pool (kept as prefix cache where hashed) and requeue it."""
        release_tail_first(self.engine.pool, req.seq)
        req.preempted = True
        req.result.preemptions += 1
        self.stats.preemptions += 1
        if req in self._running:
            self._running.remove(req)
            bisect.insort(self._waiting, req, key=lambda r: r.arrival)

    def _blocked(self, req: Request, now: float) -> None:
        """``req`` cannot fit even alone: wait ``block_wait_s`` for blocks, then fail it."""
        if req.blocked_since is None:
            req.blocked_since = now
        elif now - req.blocked_since >= self.engine.config.block_wait_s:
            pool = self.engine.pool
            need = pool.blocks_needed(req.seq, min(req.todo, self.engine.config.max_prefill_tokens))
            self._fail(req, OutOfBlocksError(
                f"this turn needs {need} more blocks of {pool.block_size} tokens but only "
                f"{pool.num_available} of {pool.num_blocks} came free within {self.engine.config.block_wait_s:g} s "
                "(idle sessions hold the rest); raise kv_budget_bytes or close idle sessions"))

    # -- finishing ------------------------------------------------------------------------

    def _remove(self, req: Request) -> None:
        if req in self._running:
            self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)
        if not req.admitted:
            req.admitted = True
            with self._mu:
                self._unadmitted -= 1

    def _settle(self, req: Request) -> None:
        result = req.result
        result.text = req.streamer.reply
        if req.decode_start is not None:
            result.decode_s = time.perf_counter() - req.decode_start
        req.done.set()

    def _drop(self, req: Request) -> None:
        """A cancelled request leaves at once; what it generated stays in its result."""
        if req.done.is_set():
            return
        self._remove(req)
        self.stats.cancelled += 1
        self._settle(req)

    def _fail(self, req: Request, exc: BaseException) -> None:
        if req.done.is_set():
            return
        self._remove(req)
        self.stats.failed += 1
        req.channel.put(Failure(exc))
        self._settle(req)

    def _finish(self, req: Request, reason: str) -> None:
        piece = req.streamer.flush()
        if piece:
            req.result.text += piece
            req.channel.put((piece, len(req.result.token_ids)))
        req.result.finish_reason = reason
        self._remove(req)
        self.stats.finished += 1
        req.channel.put(END)
        self._settle(req)

    # -- sampling (outside engine.lock: only the loop touches in-flight sequences) -------------------

    def _sample(self, plan: list[tuple[Request, int]], logits: torch.Tensor) -> None:
        rows = [(i, req) for i, (req, _) in enumerate(plan) if req.todo == 0]
        greedy = [i for i, req in rows if req.params.temperature == 0.0]
        picked: dict[int, int] = {}
        if greedy:
            picked = dict(zip(greedy, logits[greedy].argmax(dim=-1).tolist()))
        for i, req in rows:
            token = picked[i] if i in picked else req.sampler(logits[i])
            self._emit(req, token)

    def _emit(self, req: Request, token: int) -> None:
        engine, seq, result, params = self.engine, req.seq, req.result, req.params
        seq.token_ids.append(token)
        result.token_ids.append(token)
        if result.ttft_s is None:
            now = time.perf_counter()
            result.ttft_s = now - req.submitted
            req.decode_start = now
        if token in engine.eos_ids and not params.ignore_eos:
            return self._finish(req, "eos")
        piece = req.streamer.push(token)
        if piece:
            result.text += piece
            req.channel.put((piece, len(result.token_ids)))
        if req.streamer.stopped:
            return self._finish(req, "stop")
        if len(result.token_ids) >= params.max_new_tokens:
            return self._finish(req, "length")
        if len(seq.token_ids) >= engine.max_context:
            return self._finish(req, "context")
        return None
