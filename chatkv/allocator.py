"""Keep freed host memory in the process, so a step's buffers do not fault in fresh pages.

glibc's malloc gives an allocation above its mmap threshold (128 KB at
first, raised to the size of the largest such block the process has freed,
up to 32 MB) pages of its own and hands them back to the system when it is
freed, and it gives back the heap's free top once that exceeds its trim
threshold (twice the mmap threshold). The next allocation of that size then
writes fresh pages, which on this project's VM costs about nine times a
write to memory already touched (fresh memory fills at 0.5 GB/s). A step
over a longer history than any before it allocates larger attention buffers
and masks than the process ever freed, and paid that: the first turn of a
fresh process resuming a 1.3k-token conversation ran its first layer 13 ms
against 3 ms for the next turn of the same shape, about 10 ms of its time to
first token.

Threads other than the main one (the engine's loop, its OpenMP workers)
allocate from arenas of their own, made of 64 MB heaps, and glibc unmaps a
heap as soon as all of it is free, whatever the trim threshold. A long
prefill's attention frees and allocates tens of MB per layer, so its heaps
came and went layer after layer: a 250-token turn over 3.6k tokens of
history faulted in up to 1.9 GB of fresh pages (476,000 page faults) and
took 1.03 s against 0.46 s for the same step with none, in some fresh
processes and not others. A top pad of at least a heap's size
(:data:`TOP_PAD`) is what glibc checks before deleting a heap; with it, no
heap is deleted, and the same step faults about 20,000 pages the first time
and none after (``/tmp`` probe, three processes each way).

CPU inference guides keep freed memory for the same reason (jemalloc or
tcmalloc configured never to return it: PyTorch's CPU performance tuning
guide, Intel's extension). chatkv sets glibc's thresholds once per process
instead (``mallopt``): blocks up to :data:`MMAP_THRESHOLD` come from the
heap, up to :data:`TRIM_THRESHOLD` of free heap stays for reuse, and
:data:`TOP_PAD` keeps every thread's heaps. The price is memory kept after
a peak (a process's resident size does not shrink back below it, up to that
much); the pad itself is address space, not memory, until it is written.
``CHATKV_MALLOC_TUNING=0`` leaves malloc as it is; elsewhere than glibc
nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

from chatkv.config import switched_off

log = logging.getLogger(__name__)

#: Environment variable: ``0`` (or off/false/no) leaves glibc's malloc settings alone.
TUNING_ENV = "CHATKV_MALLOC_TUNING"
#: Allocations up to this size are served from the heap, not mmap'd one by one.
MMAP_THRESHOLD = 64 << 20
#: Free memory at the top of a heap kept for reuse before any is given back.
TRIM_THRESHOLD = 1 << 30
#: Extra memory asked of the system when a heap grows, and kept when it shrinks:
#: at least glibc's largest heap of a thread's arena (64 MB on 64-bit), so that
#: no such heap is ever unmapped for being free.
TOP_PAD = 64 << 20

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_result: bool | None = None


def tune_malloc() -> bool:
    """Set glibc's mmap and trim thresholds and top pad for this process, once
    (later calls return the first call's result). Returns True if all were set; False when
    ``CHATKV_MALLOC_TUNING`` turns it off, the C library is not glibc, or glibc
    refused a value (logged). Never raises."""
    global _result
    with _lock:
        if _result is None:
            _result = _tune()
        return _result


def _tune() -> bool:
    if switched_off(TUNING_ENV):
        log.debug("malloc left as it is (%s=%s)", TUNING_ENV, os.environ[TUNING_ENV])
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")  # glibc's soname (find_library would run ldconfig)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: musl and macOS have no such symbol
    except (OSError, AttributeError) as e:
        log.debug("malloc left as it is (not glibc: %s)", e)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = (bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
          and bool(mallopt(_M_TOP_PAD, TOP_PAD)))
    if not ok:
        log.warning("glibc refused chatkv's malloc thresholds; a step larger than any before may run slower")
    return ok
