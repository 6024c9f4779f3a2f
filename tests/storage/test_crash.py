"""kill -9 a process that saves chunks + index in a loop, at random moments, many times.

After every kill the store must show a state that some save committed (never
a torn one), every indexed chunk must verify, and gc must clear leftovers.
The worker is forked from this process so that it starts in milliseconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from chatkv.storage import Store, collect_garbage

from .conftest import CHUNK, FP, kv_files, kv_for, new_chunks

SID = "crash-me"


def _ids(i: int) -> list[int]:
    # grows by 30 tokens a turn and starts over every 8 turns, so saves both add
    # chunks and drop them; the last token tags the turn that saved it
    return list(range(30 * (i % 8) + 10)) + [10_000 + i]


def _worker(home: str) -> None:
    try:
        st = Store(home)
        st.acquire_lease(SID, auto_renew=False, ttl_s=60)  # a dead holder must not block the next one
        st.open_session(SID, fingerprint=FP)
        i = st.get_session(SID).n_messages
        while True:
            st.append_message(SID, "user", f"m{i}")
            ids = _ids(i)
            st.save_kv(SID, token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
            i += 1
    finally:
        os._exit(0)


def _check(home: Path) -> int:
    with Store(home) as st:
        if not st.has_session(SID):
            return 0
        msgs = st.messages(SID)
        assert [m.content for m in msgs] == [f"m{k}" for k in range(len(msgs))]  # no gaps, no torn rows
        info = st.get_session(SID)
        kv = st.load_kv(SID, fingerprint=FP)  # verifies every chunk: checksum, size, chain
        assert kv.token_ids == st.cached_token_ids(SID) and len(kv.token_ids) == info.n_cached
        if info.n_cached:
            turn = kv.token_ids[-1] - 10_000
            assert 0 <= turn < len(msgs) and kv.token_ids == _ids(turn)  # exactly one committed save
            for c in kv.chunks:
                assert torch.equal(c.tensors["kv"], kv_for(c.token_ids)["kv"])
            assert [c.info.n_tokens for c in kv.chunks] == [len(kv.token_ids[a:a + CHUNK]) for a in range(0, len(kv.token_ids), CHUNK)]
        assert st.verify_chunks() == []
        collect_garbage(st, dry_run=False, grace_s=0)
        assert not any(p.name.startswith(".tmp-") for p in (home / "kv").rglob("*")) if (home / "kv").exists() else True
        assert len(kv_files(home)) == st.disk_usage().n_chunks  # no orphans left, no dangling rows
        return len(msgs)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_kill_9_mid_save_never_leaves_a_torn_state(home: Path) -> None:
    ctx = mp.get_context("fork")
    rng = random.Random(20240611)
    Store(home).close()
    progress = []
    t_end = time.monotonic() + 12
    for _ in range(16):
        p = ctx.Process(target=_worker, args=(str(home),), daemon=True)
        p.start()
        time.sleep(rng.uniform(0.05, 0.35))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        assert p.exitcode == -signal.SIGKILL
        progress.append(_check(home))
        if time.monotonic() > t_end:
            break
    assert len(progress) >= 8
    assert progress[-1] >= 5 and progress == sorted(progress)  # workers really saved between kills; history only grows
