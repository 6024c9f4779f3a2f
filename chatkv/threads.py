"""Keep the engine's loop the only thread with an OpenMP thread pool.

PyTorch's CPU build parallelises each operator with GNU OpenMP (libgomp).
libgomp gives every thread that enters a parallel region a pool of worker
threads of its own, kept until that thread exits. When the workers of all
pools outnumber the CPUs, libgomp stops letting idle workers spin between
regions (its "throttled" spin count of 100 iterations, which no environment
variable raises), so every operator pays a futex sleep and wake-up: on this
project's 2-core machine, with two threads per pool, a SmolLM2 decode step
in the engine's loop took 77 ms when the model had been loaded on the main
thread and 44 ms when it had not, and elementwise operators ran four times
slower.

The loop runs every forward pass, so the heavy one-off work that would
otherwise give the caller's thread a pool (loading and converting weights,
packing linear layers) runs in a short-lived thread instead: its pool goes
when it exits. An application that itself runs large torch operators on
another thread still gets correct results, only slower ones.

:class:`ThreadGovernor` fits the loop's thread count to the CPUs that other
processes leave free, so that a busy neighbour does not multiply every step's
time.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import threading
import time
import weakref
from typing import Any, Callable, TypeVar

from chatkv.config import switched_off

T = TypeVar("T")

log = logging.getLogger(__name__)


#: ``omp_pause_soft`` of OpenMP 5.0's ``omp_pause_resource_t``.
_OMP_PAUSE_SOFT = 1


@functools.lru_cache(maxsize=1)
def _pause_resource() -> "Callable[[int], int] | None":
    """``omp_pause_resource_all`` of the OpenMP runtime loaded in this process
    (torch's libgomp, or an Intel OpenMP), or None where there is none."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = sorted({line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line})
    except OSError:
        return None
    for path in paths:
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def release_openmp_pool() -> bool:
    """Let the calling thread's OpenMP pool go (its worker threads exit; the
    thread's next parallel operator starts a new one): what an idle engine
    loop that keeps its thread does, so that its workers do not count beside
    another thread's pool (see the module's docstring). Returns whether the
    runtime did it (False where none is loaded or the call is missing)."""
    fn = _pause_resource()
    return fn is not None and fn(_OMP_PAUSE_SOFT) == 0


def in_passing_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` in a new thread that exits when it returns,
    and return its result (or raise its exception, traceback kept) in the
    caller. Blocks the caller meanwhile; a call made from such a thread runs
    directly."""
    if getattr(_local, "passing", False):
        return fn(*args, **kwargs)
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        _local.passing = True
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            error.append(e)

    t = threading.Thread(target=run, name=f"chatkv-{getattr(fn, '__name__', 'work')}", daemon=True)
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]


_local = threading.local()


# ------------------------------------------------------------------ the loop's thread count

#: Environment variable: ``0`` (or off/false/no) keeps the loop's thread count
#: fixed; anything else (or unset) lets :class:`ThreadGovernor` fit it.
ADAPT_ENV = "CHATKV_ADAPT_THREADS"
#: Seconds between two looks at how busy the loop's CPUs are.
ADAPT_INTERVAL_S = 0.5
#: The share of one CPU other processes must keep busy before the loop stops
#: running a thread on it. Measured on this project's 2-core VM with a
#: neighbour busy that share of the time (SmolLM2 bf16, 1k tokens of context):
#: at 0.3 one thread decoded faster (49 against 42 tokens/s) but prefilled
#: slower (41 against 36 ms to the first token); at 0.6 one thread won both
#: (48 against 36 tokens/s, 40 against 44 ms); at 1.0, 47 against 11 tokens/s
#: and 42 against 223 ms.
TAKEN_SHARE = 0.4


def threads_for(base: int, cpus: int, others: float) -> int:
    """The operator thread count for the loop: ``base`` (its count on an idle
    machine) or fewer, one less for each CPU other processes take beyond the
    ``cpus - base`` the loop leaves unused (``others`` is their use of the
    ``cpus`` in CPUs; each whole CPU they use, and a last one they use
    :data:`TAKEN_SHARE` of, counts as taken), and never fewer than 1."""
    taken = math.floor(max(0.0, others) + 1.0 - TAKEN_SHARE + 1e-9)  # (1e-9: 0.4 + 0.6 is 0.999...)
    return max(1, base - max(0, taken - max(0, cpus - base)))


class ThreadGovernor:
    """Fits the engine loop's operator thread count to the CPUs other
    processes leave it.

    PyTorch runs an operator on as many threads as there are cores, and its
    OpenMP threads wait for each other at the end of every parallel region:
    when another process keeps one of those cores busy, the thread that
    shares it runs at a fraction of its speed and every operator waits for
    it. On this project's 2-core VM, with one core kept busy by another
    process, two threads decoded at 11 tokens/s and reached a first token
    in 223 ms, where one thread decoded at 47 tokens/s in 42 ms (58 and 29
    on an idle machine with two).

    A thread of its own (:meth:`start`) looks every :data:`ADAPT_INTERVAL_S`
    at how much of the CPUs this process may run on others used meanwhile
    (``/proc/stat`` less this process's own time from ``/proc/self/stat``;
    time the hypervisor stole counts as used), so that the count is current
    when a turn arrives after an idle spell, and sets :attr:`current` to
    :func:`threads_for` that share: a thread goes at the first look that
    finds its CPU taken, and comes back after two looks in a row find it
    free. The loop reads :attr:`current` before each step and applies it to
    itself. Linux only: elsewhere :meth:`create` returns None.
    """

    def __init__(self, base: int, cpus: list[int], interval_s: float = ADAPT_INTERVAL_S) -> None:
        """Govern a loop whose thread count on an idle machine is ``base``,
        which may run on ``cpus`` (CPU numbers). Use :meth:`create`."""
        self.base = base
        self.cpus = cpus
        #: Seconds between two looks.
        self.interval_s = interval_s
        #: The thread count the loop should run on now.
        self.current = base
        #: Other processes' use of :attr:`cpus` at the last look, in CPUs (None before one).
        self.others: float | None = None
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")
        self._last = self._sample()
        self._rising = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def create(cls, base: int, setting: bool | None = None) -> "ThreadGovernor | None":
        """A governor (not started) for a loop of ``base`` threads, or None
        where there is nothing to govern: ``setting`` False (None:
        :data:`ADAPT_ENV`, on unless it says off), one thread, or no
        ``/proc`` to read."""
        if setting is None:
            setting = not switched_off(ADAPT_ENV)
        if not setting or base <= 1:
            return None
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return None
        governor = cls(base, cpus)
        return governor if governor._last is not None else None

    def start(self, owner: Any = None) -> None:
        """Start looking, in a daemon thread of its own, until :meth:`close`
        or until ``owner`` (an object the governor serves; only a weak
        reference is kept) is garbage-collected unclosed."""
        if self._thread is None:
            alive = weakref.ref(owner) if owner is not None else (lambda: True)
            self._thread = threading.Thread(target=self._watch, args=(alive,), name="chatkv-cpu-watch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop looking (idempotent); :attr:`current` stays as it is."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self, alive: Callable[[], Any]) -> None:
        while not self._stop.wait(self.interval_s) and alive() is not None:
            try:
                self.look()
            except Exception:  # noqa: BLE001 - never fatal: the count stays where it is
                log.exception("looking at the CPUs' load failed; the loop's thread count stays %d", self.current)
                return

    def _sample(self) -> tuple[float, int, int] | None:
        """``(monotonic seconds, busy ticks of self.cpus, this process's ticks)``, or None unreadable."""
        try:
            with open("/proc/stat", encoding="ascii") as f:
                stat = f.read()
            with open("/proc/self/stat", encoding="ascii", errors="replace") as f:
                own = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        wanted = {f"cpu{c}" for c in self.cpus}
        busy = 0
        for line in stat.splitlines():
            fields = line.split()
            if fields and fields[0] in wanted:
                # user nice system idle iowait irq softirq steal: all but idle and iowait
                busy += sum(int(x) for x in fields[1:4]) + sum(int(x) for x in fields[6:9])
        return time.monotonic(), busy, int(own[11]) + int(own[12])

    def look(self) -> None:
        """Measure other processes' use of :attr:`cpus` since the last look
        and :meth:`update` the count from it (nothing if ``/proc`` is unreadable)."""
        sample = self._sample()
        if sample is None or self._last is None:
            self._last = sample or self._last
            return
        (t0, busy0, own0), (t1, busy1, own1) = self._last, sample
        self._last = sample
        elapsed = (t1 - t0) * self._ticks_per_s
        if elapsed > 0:
            self.update(max(0.0, (busy1 - busy0) - (own1 - own0)) / elapsed)

    def update(self, others: float) -> int | None:
        """Take one look's finding, that other processes used ``others`` CPUs
        of :attr:`cpus`: returns the new :attr:`current`, or None where it
        stays (fewer threads at once, more after two such looks in a row)."""
        self.others = others
        want = threads_for(self.base, len(self.cpus), others)
        if want > self.current:
            self._rising += 1
            if self._rising < 2:
                return None
        self._rising = 0
        if want == self.current:
            return None
        log.info("other processes use %.1f of this process's %d CPUs: the engine's loop now runs on %d "
                 "thread(s), was %d", others, len(self.cpus), want, self.current)
        self.current = want
        return want
