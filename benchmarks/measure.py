"""What every benchmarked system shares: one timed turn's sample, the system
protocol, and probes of the machine (memory bandwidth, raw file reads, page cache).

A *system* is one way of answering the next turn of a conversation whose history
is already known: a peer (transformers, llama.cpp) or a chatkv tier. The runner
calls ``prepare`` (untimed: build whatever state the system keeps for this
history), then ``measure`` once per repeat (timed: time to first token and
decode rate of the next turn), then ``release``. Adding a system is a class
with those three methods plus a ``name``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from benchmarks.workload import Point


@dataclass
class Sample:
    """One timed next turn of one system on one history.

    Attributes:
        system: the system's row name.
        point: the history's key (``c<conv>-<bin>``).
        bin: the history-length bin (``"0.5k"``, ``"1k"``...).
        history_tokens: tokens cached before the turn.
        delta_tokens: new tokens the turn prefilled (user turn + assistant header).
        repeat: the repeat index (systems are interleaved within a repeat).
        ttft_s: from the start of the resume (or of the request, for hot
            systems) to the first generated token.
        decode_tok_s: generated tokens per second after the first one.
        tokens: the generated token ids (greedy).
        extra: system-specific facts (restore seconds, bytes read, state bytes...).
    """

    system: str
    point: str
    bin: str
    history_tokens: int
    delta_tokens: int
    repeat: int
    ttft_s: float
    decode_tok_s: float | None
    tokens: list[int]
    extra: dict[str, float] = field(default_factory=dict)


class System(Protocol):
    """A way to answer the next turn; see the module docstring."""

    name: str

    def prepare(self, point: Point) -> None:
        """Build this system's state for ``point``'s history (untimed)."""

    def measure(self, point: Point, repeat: int) -> Sample:
        """Time one next turn on ``point`` and leave the state as ``prepare`` left it."""

    def release(self, point: Point) -> None:
        """Free what ``prepare`` built."""


#: Seconds every system idles right before each timed turn (``benchmarks.run
#: --idle-s``, default 1 there; 0 here: back to back). A returning conversation
#: arrives after the user's think time, not straight after other work. On this
#: VM a turn that starts on a CPU busy a moment before ran 10 to 15% faster
#: than one after an idle second, so a turn timed back to back with other work
#: is not what a user waits for, and two systems (or a first and a next turn)
#: compare only when both idled the same.
TURN_GAP_S = 0.0


def idle_before_turn() -> None:
    """Sleep :data:`TURN_GAP_S` seconds: called by every system just before its timed turn."""
    if TURN_GAP_S > 0:
        time.sleep(TURN_GAP_S)


@dataclass
class Unavailable:
    """A system that could not run here, and why (shown as a row of the report)."""

    name: str
    reason: str


def sample_for(system: str, point: Point, repeat: int, ttft_s: float, decode_s: float,
               tokens: list[int], **extra: float) -> Sample:
    """Build a :class:`Sample`; ``decode_s`` is the time from the first to the last token
    (``extra`` facts that are None are left out)."""
    rate = (len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else None
    return Sample(system, point.key, point.bin, point.n_cached, point.n_delta, repeat, ttft_s, rate,
                  list(tokens), {k: float(v) for k, v in extra.items() if v is not None})


# --- machine probes ---------------------------------------------------------------------


def memory_bandwidth(n_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Read bandwidth of main memory with torch's current thread count (bytes/s, best of ``repeats``).

    A sum over a float32 tensor far larger than the caches reads every byte once,
    which is what decoding does with the weights.
    """
    x = torch.ones(n_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        float(x.sum())
        best = min(best, time.perf_counter() - t0)
    return n_bytes / best


def write_json(path: Path | None, data: object, indent: int = 2) -> None:
    """Write ``data`` as JSON to ``path`` (its folder made first); nothing when ``path`` is None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent))


def raw_read(paths: Iterable[Path], repeats: int = 1) -> tuple[int, float]:
    """Read ``paths`` whole with plain ``read`` calls, ``repeats`` times;
    returns ``(bytes, median seconds)``. One read of a few tens of MB from
    the page cache varies twofold on this project's VM (6 to 15 GB/s in one
    run), so a reference for a median of restores should be a median too;
    after the first read the files are in the page cache, whatever they were."""
    paths = list(paths)
    times = []
    for _ in range(repeats):
        total = 0
        t0 = time.perf_counter()
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while chunk := f.read(8 << 20):
                    total += len(chunk)
        times.append(time.perf_counter() - t0)
    return total, statistics.median(times)


def raw_read_into(paths: Iterable[Path], repeats: int = 5) -> tuple[int, float]:
    """Read ``paths`` whole with plain ``readinto`` calls into one buffer the
    size of all of them, written once before (as a restore writes a pool whose
    pages a warm-up touched); returns ``(bytes, median seconds of repeats)``.
    Unlike :func:`raw_read`, whose 8 MB buffers are freed and reused and so
    stay in the CPU's cache, this is the cost of one copy of the bytes into
    memory that is not."""
    paths = list(paths)
    sizes = [p.stat().st_size for p in paths]
    buf = bytearray(sum(sizes))  # zero-filled: its pages are written
    view = memoryview(buf)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        at = 0
        for p, size in zip(paths, sizes):
            with open(p, "rb", buffering=0) as f:
                end = at + size
                while at < end:
                    n = f.readinto(view[at: min(end, at + (8 << 20))])
                    if not n:
                        raise OSError(f"{p} ended early")
                    at += n
        times.append(time.perf_counter() - t0)
    return len(buf), statistics.median(times)


def evict_page_cache(paths: Iterable[Path], method: str = "fadvise") -> str:
    """Drop ``paths`` from the OS page cache so the next read comes from the device.

    Args:
        method: ``"fadvise"`` (``POSIX_FADV_DONTNEED`` on each file: needs no
            privileges and leaves other files, e.g. the model's weights, cached),
            ``"drop_caches"`` (``echo 1 > /proc/sys/vm/drop_caches``: root only,
            the whole machine) or ``"none"``.

    Returns:
        The method that worked, or ``"none"`` (warm reads) if none did.
    """
    paths = list(paths)
    if method == "drop_caches":
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            return "drop_caches"
        except OSError:
            method = "fadvise"
    if method == "fadvise" and hasattr(os, "posix_fadvise"):
        try:
            for p in paths:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            return "fadvise"
        except OSError:
            pass
    return "none"


def can_drop_caches() -> bool:
    """Whether this process may write ``/proc/sys/vm/drop_caches`` (it does not write it)."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (or ``"unknown"``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def lcp(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
