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
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


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
