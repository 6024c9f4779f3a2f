"""The scheduler: the engine's loop, sole owner of its block pool and model.

One background thread, the *loop*, is the only code that changes the block
pool, the tier manager's sessions or runs the model. Other threads ask it
for work in two ways:

* **turns** (:meth:`Scheduler.submit`): a sequence to prefill and decode,
  batched with every other turn in flight (continuous batching);
* **jobs** (:meth:`Scheduler.run`, :meth:`Scheduler.submit_job`): a function
  the loop runs between two forward steps, its result or exception handed
  back through a :class:`concurrent.futures.Future`. Aligning a session to new
  token ids, restoring chunks into blocks, offload and reload, release, fork,
  snapshots for a save and the fidelity calibration are jobs.

Each loop iteration:

1. takes new turns and jobs, and runs the jobs in arrival order;
2. plans a step: one decode token for every running turn, then chunks of
   unfinished prefills, then waiting turns admitted in arrival order, all
   within a token budget (``EngineConfig.max_prefill_tokens``) and the pool's
   free blocks;
3. runs ONE packed forward over the plan;
4. samples each sequence that reached its end, detokenizes and pushes the
   text pieces to the turn's channel, which the consumer drains from its own
   thread (:meth:`Engine.generate`) or event loop (:mod:`chatkv.aio`).

Memory pressure is decided in one place, :meth:`Scheduler._make_room`, which
sees every session: evictable cached blocks (the pool does that), then idle
sessions demoted by the tier manager (least recently used first), then
*preemption* of the lowest-priority turn in flight, the latest to arrive: its
blocks go back to the pool, last block first, so its full blocks stay in the
prefix cache; it is requeued, and on re-admission revives whatever is still
cached and recomputes the rest. Its sampled tokens are kept, so greedy output
does not change. A turn that cannot fit even with every other turn preempted
waits ``EngineConfig.block_wait_s`` for blocks (a session closing) and then
gets :class:`~chatkv.errors.OutOfBlocksError`; one that needs more blocks than
the pool has gets it at once. Planning never takes blocks it might have to
give back: a preempted turn's revivable prefix is measured first
(:meth:`BlockPool.prefix_plan`).

Ownership: a turn's sequence, stats, sampler and streamer are touched only by
the loop from submission until its ``done`` event is set; the consumer reads
them afterwards.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

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
from chatkv.errors import EngineClosedError, OutOfBlocksError, QueueFullError
from chatkv.runner import StepInput
from chatkv.sampling import Sampler
from chatkv.sequence import Sequence
from chatkv.stats import TurnStats
from chatkv.threads import ThreadGovernor, release_openmp_pool

__all__ = ["Job", "Pending", "Request", "Scheduler", "SchedulerStats", "next_nonblocking"]

if TYPE_CHECKING:
    from chatkv.engine import Engine

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The loop exits after this long with nothing to do (and restarts on the next
#: turn or job) while another engine's loop runs in the process: each loop
#: thread that ran the model holds an OpenMP pool, and once the pools' threads
#: outnumber the cores libgomp stops letting them spin, which makes every
#: operator slower.
IDLE_EXIT_S = 2.0
#: Alone in the process, an idle loop keeps its thread this long, its OpenMP
#: pool let go after :data:`IDLE_EXIT_S` (:func:`chatkv.threads.release_openmp_pool`)
#: so that its workers do not crowd another thread's operators (where the
#: runtime cannot let it go, the thread ends then, as beside another loop): a turn on a new
#: loop thread paid for its first steps there (a REPL turn after a 2.5 s pause
#: took 8 to 18 ms more to its first token than one after 1.5 s, when the loop
#: thread still ran; SmolLM2, 1.8k tokens).
LONE_IDLE_EXIT_S = 600.0
#: The schedulers whose loop thread runs, in this process.
_LOOPS: "set[Scheduler]" = set()
_LOOPS_LOCK = threading.Lock()
#: How long the loop sleeps when no turn can make progress (all blocked on blocks).
_STALL_WAIT_S = 0.01
#: How often a blocked consumer checks that the loop is still alive.
_POLL_S = 0.5
#: Longest the loop waits, after a step that gave a turn its first text, for
#: the turn's consumer to take it before the next step (see :meth:`Scheduler._step`).
FIRST_PIECE_WAIT_S = 0.002

# ------------------------------------------------------------------------------ requests


@dataclass(eq=False)
class Request:
    """One turn in flight: a sequence to extend, how to sample, where the output goes.

    With ``prefill_only`` the turn computes every token's KV and ends with
    ``finish_reason == "prefilled"`` without sampling.
    """

    seq: Sequence
    params: SamplingParams
    stats: TurnStats
    sampler: Sampler
    streamer: TextStreamer
    arrival: int
    submitted: float
    prefill_only: bool = False
    channel: Channel = field(default_factory=Channel)
    done: threading.Event = field(default_factory=threading.Event)
    admitted: bool = False  # admitted at least once (no longer counts against max_waiting)
    preempted: bool = False  # released by preemption; revive cached blocks on re-admission
    blocked_since: float | None = None
    decode_start: float | None = None
    pieces_sent: bool = False  # some text of the reply went into the channel
    # Written by the consumer as it takes pieces: how much of the reply it has seen.
    delivered_tokens: int = 0
    delivered_text: str = ""

    @property
    def todo(self) -> int:
        """Tokens of the sequence not yet computed (1 while decoding)."""
        return len(self.seq.token_ids) - self.seq.num_computed



@dataclass(eq=False)
class Job:
    """A function the loop runs between forward steps; ``future`` gets its result."""

    name: str
    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)

    def run(self) -> None:
        """Run on the loop, handing the result or the exception to ``future``."""
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn()
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


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
    jobs: int = 0
    blocked_turns: int = 0  # turns that had to wait for blocks at least once
    reclaims: int = 0  # times idle sessions were demoted to make room for a step
    threads: int = 0  # threads the loop runs the model on, where it is governed (0: not governed)
    thread_changes: int = 0  # times the loop changed that count for other processes' load


@dataclass
class _StepPlan:
    """A step being planned: what runs, the blocks it reserves, the prefill tokens left."""

    budget: int
    now: float
    items: list[tuple[Request, int]] = field(default_factory=list)
    reserved: int = 0

    def add(self, req: Request, n: int, need: int) -> None:
        self.items.append((req, n))
        self.reserved += need
        if req.todo > 1:  # decode tokens were set aside before the budget was counted
            self.budget -= n


# ------------------------------------------------------------------------------ scheduler


class Scheduler:
    """The engine's loop: batches every turn in flight and runs jobs between steps.

    Thread-safe: :meth:`submit`, :meth:`stream`, :meth:`cancel`, :meth:`run`
    and :meth:`submit_job` may be called from any thread. The loop thread
    starts on the first submission and exits after :data:`IDLE_EXIT_S`
    without work where another engine's loop runs in the process, after
    :data:`LONE_IDLE_EXIT_S` where none does. The engine's pool is bound to it: with
    ``CHATKV_CHECK_OWNER=1`` any pool access from another thread fails.
    """

    def __init__(self, engine: Engine) -> None:
        """A scheduler for ``engine`` (no thread is started yet)."""
        self.engine = engine
        self.stats = SchedulerStats()
        self._mu = threading.Lock()
        self._wake = threading.Condition(self._mu)
        self._progress = threading.Condition(threading.Lock())
        self._incoming: list[Request] = []
        self._jobs: list[Job] = []
        self._first_pieces: list[Channel] = []  # channels given a turn's first text this step (loop only)
        self._unadmitted = 0  # submitted, not yet admitted nor finished (bounded by max_waiting)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._arrivals = itertools.count()
        # Owned by the loop thread:
        self._waiting: list[Request] = []  # sorted by arrival
        self._running: list[Request] = []  # sorted by arrival
        #: Fits the loop's thread count to the CPUs other processes leave free (CPU engines).
        self.threads = ThreadGovernor.create(torch.get_num_threads(), engine.config.adapt_threads) \
            if engine.pool.kv.device.type == "cpu" else None
        if self.threads is not None:
            self.stats.threads = self.threads.current
            self.threads.start(owner=self)
        engine.pool.bind_owner(self.on_loop)

    def counters(self) -> SchedulerStats:
        """A copy of :attr:`stats`, for :meth:`restore_counters`."""
        return replace(self.stats)

    def restore_counters(self, saved: SchedulerStats) -> None:
        """Put back the counters of a copy :meth:`counters` made (after work
        that is not to count, such as the warm-up's rehearsal), except the
        thread gauge and its changes, which follow other processes' load."""
        for f in fields(saved):
            if f.name not in ("threads", "thread_changes"):
                setattr(self.stats, f.name, getattr(saved, f.name))

    def on_loop(self) -> bool:
        """True when called from the loop thread."""
        return threading.current_thread() is self._thread

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new turns and jobs (:class:`~chatkv.errors.EngineClosedError`),
        let the loop finish what is queued or in flight, and wait up to
        ``timeout`` seconds for its thread to end (at once, where it would
        otherwise idle first). Returns whether it ended.
        Idempotent; called from the loop itself, it does not wait."""
        if self.threads is not None:
            self.threads.close()
        with self._mu:
            self._closed = True
            thread = self._thread
            self._wake.notify_all()
        if thread is None or thread is threading.current_thread():
            return thread is None
        thread.join(timeout)
        return not thread.is_alive()

    def idle(self) -> bool:
        """On the loop: True when no turn is queued, waiting or running."""
        with self._mu:
            incoming = bool(self._incoming)
        return not (incoming or self._waiting or self._running)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def _ensure_thread(self) -> None:  # under self._mu
        if self._closed:
            raise EngineClosedError("the engine was closed; it runs no more turns or jobs")
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="chatkv-loop", daemon=True)
            self._thread.start()

    # -- jobs -----------------------------------------------------------------------------

    def submit_job(self, fn: Callable[[], T], name: str = "job") -> "Future[T]":
        """Queue ``fn`` to run on the loop before its next step; returns its future."""
        job = Job(name, fn)
        with self._mu:
            self._jobs.append(job)
            self._ensure_thread()
            self._wake.notify()
        return job.future

    def run(self, fn: Callable[[], T], name: str = "job") -> T:
        """Run ``fn`` on the loop and return its result (re-raising its exception).
        Called from the loop itself, ``fn`` runs at once."""
        if self.on_loop():
            return fn()
        future = self.submit_job(fn, name)
        while True:
            try:
                return future.result(_POLL_S)
            except TimeoutError:
                with self._mu:
                    alive = self._thread is not None and self._thread.is_alive()
                    queued = any(j.future is future for j in self._jobs)
                if not alive and not queued and not future.done():
                    raise RuntimeError(f"the chatkv loop stopped with job {name!r} pending") from None

    def wait_until(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until ``predicate()`` (evaluated after each loop iteration) is true;
        returns its last value (False if ``timeout`` passed first)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._progress:
            while not predicate():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._progress.wait(_POLL_S if left is None else min(left, _POLL_S))
            return True

    # -- the consumer's side ------------------------------------------------------------

    def submit(self, seq: Sequence, params: SamplingParams, stats: TurnStats,
               prefill_only: bool = False) -> Request:
        """Queue a turn that extends ``seq``; the loop takes it from here.

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
            now = time.perf_counter()
            req = Request(seq, params, stats, Sampler(params), TextStreamer(engine.tokenizer, params.stop),
                          arrival=next(self._arrivals), submitted=now, prefill_only=prefill_only)
            stats.finish_reason = "interrupted"  # until it ends otherwise
            stats.prefilled_tokens = len(seq.token_ids) - seq.num_computed
            if stats.started_at is None:
                stats.started_at = now
            self._unadmitted += 1
            self.stats.submitted += 1
            self._incoming.append(req)
            self._ensure_thread()
            self._wake.notify()
        return req

    def stream(self, req: Request) -> Iterator[Any]:
        """Yield ``req``'s text pieces as the loop produces them.

        Returns when the generation ends; re-raises the exception it failed
        with. Closing the iterator early (or an exception in the consumer, such
        as ``KeyboardInterrupt``) cancels the request and waits until the loop
        has let go of it, keeping exactly the pieces the consumer took. In
        non-blocking mode (:func:`next_nonblocking`) a :class:`Pending` is
        yielded instead of waiting.
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

    def cancel(self, req: Request) -> None:
        """Stop ``req`` at the next step and wait until the loop has let go of it.

        What the consumer has not taken yet is dropped, its KV too, so the
        reply holds exactly what the user saw; ``finish_reason`` is
        ``"interrupted"`` unless the turn had already ended with all of it taken.
        """
        self.run(lambda: self._drop(req), "cancel")

    def _check_alive(self, req: Request) -> None:
        with self._mu:
            alive = self._thread is not None and self._thread.is_alive()
        if not alive and not req.done.is_set():
            raise RuntimeError("the chatkv loop thread stopped with a turn in flight")

    @property
    def num_waiting(self) -> int:
        """Turns submitted and not yet started."""
        with self._mu:
            return self._unadmitted

    # -- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        with _LOOPS_LOCK:
            _LOOPS.add(self)
        try:
            self._run_loop()
        finally:
            with _LOOPS_LOCK:
                _LOOPS.discard(self)

    def _idle_exit(self, idle_since: float) -> bool:  # under self._mu, after IDLE_EXIT_S without work
        with _LOOPS_LOCK:
            alone = _LOOPS == {self}
        return not alone or time.monotonic() - idle_since >= LONE_IDLE_EXIT_S

    def _run_loop(self) -> None:
        while True:
            with self._mu:
                idle_since = time.monotonic()
                pool_kept = True
                while not (self._incoming or self._jobs or self._waiting or self._running):
                    if self._closed:
                        self._thread = None
                        return
                    if not self._wake.wait(IDLE_EXIT_S) and not (self._incoming or self._jobs):
                        if self._idle_exit(idle_since):
                            self._thread = None
                            return
                        if pool_kept:  # idle and alone: the thread stays, its workers go
                            pool_kept = False
                            if not release_openmp_pool():  # no runtime call for it: the thread goes, as beside others
                                self._thread = None
                                return
                for req in self._incoming:
                    bisect.insort(self._waiting, req, key=lambda r: r.arrival)
                self._incoming.clear()
                jobs, self._jobs = self._jobs, []
            self._govern_threads()
            for job in jobs:
                self.stats.jobs += 1
                job.run()
            progressed = True
            if self._waiting or self._running:
                try:
                    progressed = self._step()
                except BaseException as exc:  # never leave a consumer waiting on a dead loop
                    log.exception("the scheduler step failed; failing the turns in flight")
                    for req in self._waiting + self._running:
                        self._fail(req, exc)
            with self._progress:
                self._progress.notify_all()
            if not progressed:
                with self._mu:
                    if not (self._incoming or self._jobs):
                        self._wake.wait(_STALL_WAIT_S)

    def _step(self) -> bool:
        """One step; returns False if nothing could run (every request is blocked)."""
        engine = self.engine
        plan = self._plan()
        if not plan:
            return False
        try:
            assert sum(engine.pool.blocks_needed(r.seq, n) for r, n in plan) <= engine.pool.num_available, \
                "the plan reserves more blocks than the pool has"
            batch = [StepInput(r.seq, r.seq.token_ids[r.seq.num_computed : r.seq.num_computed + n])
                     for r, n in plan]
            logits = engine.runner.forward(batch)
        except BaseException as exc:
            log.exception("a forward step failed")
            for req, _ in plan:
                self._fail(req, exc)
            return True
        stats = self.stats
        stats.steps += 1
        tokens = sum(n for _, n in plan)
        stats.forward_tokens += tokens
        stats.max_batch_seqs = max(stats.max_batch_seqs, len(plan))
        stats.max_batch_tokens = max(stats.max_batch_tokens, tokens)
        self._sample(plan, logits)
        self._hand_over_first_pieces()
        return True

    def _hand_over_first_pieces(self) -> None:
        """Let the consumers of the turns whose first text this step put take
        it before the next step starts (at most :data:`FIRST_PIECE_WAIT_S` in
        all): the next step keeps both cores busy with its operator threads, and
        a consumer woken just then waited for a core, 3 to 6 ms in a third of
        the turns on this project's 2-core VM, against 0.3 ms otherwise (the
        time to first token the caller sees, not :attr:`TurnStats.ttft_s`)."""
        if not self._first_pieces:
            return
        deadline = time.perf_counter() + FIRST_PIECE_WAIT_S
        for channel in self._first_pieces:
            if not channel.wait_drained(max(0.0, deadline - time.perf_counter())):
                break  # not read now: the consumer is elsewhere, the loop goes on
        self._first_pieces.clear()

    def _govern_threads(self) -> None:
        """On the loop, before its jobs and its step: run on the thread count
        the governor advises now (:class:`ThreadGovernor`), if it is not the
        loop thread's count already (a new loop thread starts with the count
        last set)."""
        if self.threads is None:
            return
        n = self.threads.current
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
            if n != self.stats.threads:
                self.stats.thread_changes += 1
            self.stats.threads = n

    # -- planning ------------------------------------------------------------------------

    def _plan(self) -> list[tuple[Request, int]]:
        """Choose this step's ``(request, token count)`` pairs, making room under pressure."""
        cfg = self.engine.config
        step = _StepPlan(
            budget=max(0, cfg.max_prefill_tokens - sum(1 for r in self._running if r.todo == 1)),
            now=time.monotonic(),
        )
        self._plan_running(step)
        self._plan_admissions(step)
        return step.items

    def _short(self, step: _StepPlan, need: int) -> bool:
        return need > self.engine.pool.num_available - step.reserved

    def _make_room(self, step: _StepPlan, need: int, req: Request, preempt: bool) -> bool:
        """The one place memory pressure is decided: demote idle sessions, then
        (with ``preempt``) release turns that arrived after ``req``, until ``need``
        more blocks fit this step. Returns whether they fit."""
        if not self._short(step, need):
            return True
        self.stats.reclaims += 1
        self.engine.tiers.reclaim(step.reserved + need)
        while preempt and self._short(step, need):
            victim = self._victim(req)
            if victim is None:
                break
            self._preempt(victim)
        return not self._short(step, need)

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
            if not self._make_room(step, need, req, preempt=True):
                if self._others_hold_blocks(req):
                    self._preempt(req)  # a higher-priority request holds what it needs: wait behind it
                else:
                    self._blocked(req, step.now)
                    i += 1
                continue
            req.blocked_since = None
            step.add(req, n, need)
            i += 1

    def _admission_need(self, req: Request, budget: int) -> tuple[int, int]:
        """``(tokens to run, blocks needed)`` to admit ``req`` now, counting the
        cached blocks a preempted request would revive, without taking any."""
        pool, seq = self.engine.pool, req.seq
        if not req.preempted:
            n = min(req.todo, budget)
            return n, pool.blocks_needed(seq, n)
        matched, revived = pool.prefix_plan(seq.token_ids, seq.shift)
        n = min(len(seq.token_ids) - matched, budget)
        bs = pool.block_size
        return n, revived + -(-(matched + n) // bs) - matched // bs

    def _plan_admissions(self, step: _StepPlan) -> None:
        """Start waiting requests in arrival order while the budget and the pool
        allow; these never preempt running ones."""
        pool, cfg = self.engine.pool, self.engine.config
        waiting, running = self._waiting, self._running
        while waiting and step.budget > 0 and len(running) < cfg.max_num_seqs:
            req = waiting[0]
            n, need = self._admission_need(req, step.budget)
            if self._never_fits(req, n):
                continue
            # Nothing runs, so nothing else will make room: lower-priority waiting requests may be released.
            if not self._make_room(step, need, req, preempt=not running):
                if not running and not self._others_hold_blocks(req):
                    self._blocked(req, step.now)
                return
            if req.preempted:
                # Making room may have released other holders of this request's prefix
                # blocks, so reviving them now takes more from the pool: measure again.
                n, need = self._admission_need(req, step.budget)
                if self._short(step, need):
                    return
                pool.revive_prefix(req.seq)
                req.preempted = False
                req.stats.recomputed_tokens += req.todo
                n = min(req.todo, step.budget)
                need = pool.blocks_needed(req.seq, n)
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
        self.engine.pool.release_tail_first(req.seq)
        req.preempted = True
        req.stats.preemptions += 1
        self.stats.preemptions += 1
        log.debug("preempted a turn of %d tokens under memory pressure", len(req.seq.token_ids))
        if req in self._running:
            self._running.remove(req)
            bisect.insort(self._waiting, req, key=lambda r: r.arrival)

    def _blocked(self, req: Request, now: float) -> None:
        """``req`` cannot fit even alone: wait ``block_wait_s`` for blocks, then fail it."""
        if req.blocked_since is None:
            req.blocked_since = now
            self.stats.blocked_turns += 1
        elif now - req.blocked_since >= self.engine.config.block_wait_s:
            pool = self.engine.pool
            need = pool.blocks_needed(req.seq, min(req.todo, self.engine.config.max_prefill_tokens))
            self._fail(req, OutOfBlocksError(
                f"this turn needs {need} more blocks of {pool.block_size} tokens but only "
                f"{pool.num_available} of {pool.num_blocks} came free within {self.engine.config.block_wait_s:g} s "
                "(busy sessions hold the rest); raise kv_budget_bytes or close idle sessions"))

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

    def _settle(self, req: Request, last: Any = None) -> None:
        """Complete ``req``'s stats, then hand the consumer ``last`` (END or a
        Failure), then mark it done: a consumer that sees the end reads final stats."""
        stats = req.stats
        stats.text = req.streamer.reply
        if req.decode_start is not None:
            stats.decode_s = time.perf_counter() - req.decode_start
        if last is not None:
            req.channel.put(last)
        req.done.set()

    def _drop(self, req: Request) -> None:
        """Cancel ``req`` (on the loop): it leaves at once if still in flight, and
        whatever the consumer did not take is cut from its reply and its KV."""
        if not req.done.is_set():
            self._remove(req)
            with self._mu:
                self._incoming = [r for r in self._incoming if r is not req]
            self.stats.cancelled += 1
            self._settle(req)
        stats, seq = req.stats, req.seq
        extra = len(stats.token_ids) - req.delivered_tokens
        if extra <= 0 and stats.finish_reason != "interrupted":
            return
        if extra > 0:
            keep = len(seq.token_ids) - extra
            if seq.num_computed > keep:
                self.engine.pool.truncate(seq, keep)
            del seq.token_ids[keep:]
            del stats.token_ids[req.delivered_tokens :]
        stats.text = req.delivered_text
        stats.finish_reason = "interrupted"

    def _fail(self, req: Request, exc: BaseException) -> None:
        if req.done.is_set():
            return
        self._remove(req)
        self.stats.failed += 1
        self._settle(req, Failure(exc))

    def _finish(self, req: Request, reason: str) -> None:
        piece = req.streamer.flush()
        if piece:
            req.channel.put((piece, len(req.stats.token_ids)))
        req.stats.finish_reason = reason
        self._remove(req)
        self.stats.finished += 1
        self._settle(req, END)

    # -- sampling -------------------------------------------------------------------------

    def _sample(self, plan: list[tuple[Request, int]], logits: torch.Tensor) -> None:
        rows = [(i, req) for i, (req, _) in enumerate(plan) if req.todo == 0]
        greedy = [i for i, req in rows if req.params.temperature == 0.0 and not req.prefill_only]
        picked: dict[int, int] = {}
        if greedy:
            picked = dict(zip(greedy, logits[greedy].argmax(dim=-1).tolist()))
        for i, req in rows:
            if req.prefill_only:
                self._finish(req, "prefilled")
                continue
            token = picked[i] if i in picked else req.sampler(logits[i])
            self._emit(req, token)

    def _emit(self, req: Request, token: int) -> None:
        engine, seq, stats, params = self.engine, req.seq, req.stats, req.params
        seq.token_ids.append(token)
        stats.token_ids.append(token)
        if stats.ttft_s is None:
            now = time.perf_counter()
            stats.ttft_s = now - (stats.started_at if stats.started_at is not None else req.submitted)
            req.decode_start = now
        if token in engine.eos_ids and not params.ignore_eos:
            return self._finish(req, "eos")
        piece = req.streamer.push(token)
        if piece:
            req.channel.put((piece, len(stats.token_ids)))
            if not req.pieces_sent:
                req.pieces_sent = True
                self._first_pieces.append(req.channel)
        if req.streamer.stopped:
            return self._finish(req, "stop")
        if len(stats.token_ids) >= params.max_new_tokens:
            return self._finish(req, "length")
        if len(seq.token_ids) >= engine.max_context:
            return self._finish(req, "context")
        return None
