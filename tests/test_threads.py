"""The engine loop's thread count follows the CPUs other processes leave free
(:class:`chatkv.threads.ThreadGovernor`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from chatkv import Chat, EngineConfig
from chatkv.engine import Engine
from chatkv.models import load_model
from chatkv.threads import ADAPT_ENV, TAKEN_SHARE, ThreadGovernor, threads_for


@pytest.mark.parametrize("base, cpus, others, want", [
    (2, 2, 0.0, 2), (2, 2, TAKEN_SHARE - 0.01, 2), (2, 2, TAKEN_SHARE, 1), (2, 2, 1.0, 1), (2, 2, 2.0, 1),
    (4, 4, 1.0 + TAKEN_SHARE, 2), (16, 32, 1.0, 16), (16, 32, 20.0, 12), (1, 2, 0.0, 1),
    (4, 2, 0.0, 4), (4, 2, 1.0, 3),  # more threads than CPUs: as many as asked for while they are free
])
def test_a_cpu_counts_as_taken_from_its_share(base: int, cpus: int, others: float, want: int) -> None:
    assert threads_for(base, cpus, others) == want


def test_a_thread_goes_at_once_and_comes_back_after_two_free_looks() -> None:
    governor = ThreadGovernor(2, [0, 1])
    assert governor.update(1.0) == 1 and governor.current == 1
    assert governor.update(0.0) is None  # one free look is not enough
    assert governor.update(0.6) is None  # taken again: the free looks start over
    assert governor.update(0.0) is None
    assert governor.update(0.0) == 2 and governor.current == 2
    assert governor.update(0.1) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_setting_and_the_environment_turn_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADAPT_ENV, "0")
    assert ThreadGovernor.create(2) is None
    assert ThreadGovernor.create(2, True) is not None
    monkeypatch.setenv(ADAPT_ENV, "1")
    assert ThreadGovernor.create(2) is not None
    assert ThreadGovernor.create(2, False) is None
    assert ThreadGovernor.create(1, True) is None  # one thread: nothing to give up


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
def test_a_busy_neighbour_takes_the_loop_down_to_one_thread_and_back() -> None:
    old_cpus, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
    cpus = sorted(old_cpus)[:2]
    os.sched_setaffinity(0, cpus)  # this process on two CPUs, the neighbour on the second of them
    torch.set_num_threads(2)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpus[1]}))
    engine = None
    try:
        engine = Engine(load_model("tiny:llama"),
                        EngineConfig(num_blocks=256, block_size=4, warmup=False, adapt_threads=True))
        governor = engine.scheduler.threads
        assert governor is not None and governor.current == 2
        governor.interval_s = 0.05

        def turns_until(threads: int) -> bool:
            for i in range(500):  # each turn's steps ask the governor; it looks every 0.05 s
                if engine.scheduler.stats.threads == threads:
                    return True
                chat = Chat(f"t{i}", engine=engine, persist=False, max_new_tokens=8, ignore_eos=True)
                chat.send("Hello there")
                chat.close()
            return False

        assert turns_until(1), governor.others
        assert governor.others is not None and governor.others >= TAKEN_SHARE
        assert engine.call(torch.get_num_threads) == 1  # the loop's operators run on one thread
        busy.kill()
        busy.wait()
        assert turns_until(2), governor.others
        assert engine.call(torch.get_num_threads) == 2 and engine.scheduler.stats.thread_changes == 2
    finally:
        busy.kill()
        busy.wait()
        if engine is not None:
            engine.close()
        os.sched_setaffinity(0, old_cpus)
        torch.set_num_threads(old_threads)


_RELEASE_PROBE = """
import os, threading, torch
from chatkv.threads import release_openmp_pool

torch.set_num_threads(2)
def native():  # OS threads that are not Python's: OpenMP workers among them
    return len(os.listdir("/proc/self/task")) - threading.active_count()

x = torch.randn(256, 256)
(x @ x).sum()  # this thread's pool: one worker beside it
with_pool = native()
released = release_openmp_pool()
without = native()
(x @ x).sum()  # a new pool for the next operator
print(with_pool, released, without, native())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_thread_lets_its_openmp_pool_go_and_gets_a_new_one_with_its_next_operator() -> None:
    # An idle engine loop alone in the process keeps its thread but not its workers.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", _RELEASE_PROBE], capture_output=True, text=True, check=True,
                          env=env, cwd=root)
    with_pool, released, without, again = done.stdout.split()
    assert released == "True"
    assert int(with_pool) > int(without) and int(again) == int(with_pool), done.stdout
