"""chatkv.allocator: glibc's malloc set once per process to keep freed memory, or left alone when asked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent("""
    import ctypes, json
    from chatkv.allocator import tune_malloc
    first, second = tune_malloc(), tune_malloc()
    libc = ctypes.CDLL("libc.so.6")
    # A freed 8 MB block: with the default thresholds glibc unmaps it; tuned, the heap keeps it.
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def rss_kb():
        return int(open("/proc/self/statm").read().split()[1]) * 4
    p = libc.malloc(8 << 20); ctypes.memset(p, 1, 8 << 20)
    before = rss_kb(); libc.free(p); after = rss_kb()
    print(json.dumps({"first": first, "second": second, "kept_kb": after - before}))
""")


def _run(env_value: str | None) -> dict:
    import json

    env = dict(os.environ)
    env.pop("CHATKV_MALLOC_TUNING", None)
    if env_value is not None:
        env["CHATKV_MALLOC_TUNING"] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc only")
def test_tuned_malloc_keeps_a_freed_block_and_off_leaves_glibc_as_it_is() -> None:
    tuned = _run(None)
    assert tuned["first"] is True and tuned["second"] is True
    assert tuned["kept_kb"] > -1024  # the 8 MB stayed in the process (no page handed back)
    plain = _run("0")
    assert plain["first"] is False and plain["second"] is False
    assert plain["kept_kb"] <= -(7 << 10)  # glibc's default: the block was unmapped on free


_THREAD_PROBE = textwrap.dedent("""
    import ctypes, json, resource, threading
    from chatkv.allocator import tune_malloc
    tuned = tune_malloc()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    faults = []
    def work():
        # As a long prefill's attention does, layer after layer: two 40 MB
        # buffers live at once (more than one 64 MB heap of a thread's arena
        # holds), written, then freed.
        for _ in range(4):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [libc.malloc(40 << 20) for _ in range(2)]
            for p in blocks:
                ctypes.memset(p, 1, 40 << 20)
            for p in blocks:
                libc.free(p)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    t = threading.Thread(target=work)
    t.start(); t.join()
    print(json.dumps({"tuned": tuned, "faults": faults}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc only")
def test_a_threads_freed_heaps_are_kept_for_its_next_buffers() -> None:
    import json

    def run(env_value: str | None) -> dict:
        env = dict(os.environ)
        env.pop("CHATKV_MALLOC_TUNING", None)
        if env_value is not None:
            env["CHATKV_MALLOC_TUNING"] = env_value
        out = subprocess.run([sys.executable, "-c", _THREAD_PROBE], env=env, capture_output=True, text=True,
                             check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    pages = (80 << 20) // os.sysconf("SC_PAGE_SIZE")  # the two buffers' pages
    tuned = run(None)
    assert tuned["tuned"] is True
    assert tuned["faults"][0] >= pages // 2  # the first time, fresh pages
    assert all(f < pages // 20 for f in tuned["faults"][1:]), tuned["faults"]  # then the same ones again
    plain = run("0")
    assert plain["tuned"] is False
    assert all(f >= pages // 2 for f in plain["faults"][1:]), plain["faults"]  # glibc gave them back each time
