"""kill -9 a process that saves chunks + index in a loop, at chosen moments, many times.

Each worker arms one trap (a point inside a save: writing a temp file,
fsyncing it, renaming it, committing the index, unlinking a dropped file)
to fire on its n-th call. There it tells the parent through a pipe and
blocks; the parent then kills it with SIGKILL. So every kill lands inside
the save at a known step, with no clock involved. After every kill the store
must show a state that some save committed (never a torn one), every indexed
chunk must verify, and the next Store to open must already have removed the
dead worker's leftovers (temp files, uncommitted chunk files), without gc's
grace period: gc then finds nothing. The worker is forked from this process
so that it starts in milliseconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import select
import signal
import threading
from pathlib import Path

import pytest
import torch
from chatkv.storage import DebrisReport, Store, collect_garbage

from .conftest import CHUNK, FP, kv_files, kv_for, new_chunks

SID = "crash-me"

#: (what, where): the call a trap interrupts. os.* are patched module-wide in the
#: worker only (it is a forked child).
TRAPS = {
    "write": ("chatkv.storage.chunkfile", "_write_all"),  # temp file created, no bytes yet
    "fsync": ("os", "fsync"),  # bytes written, not durable yet (also the directory fsyncs)
    "rename": ("os", "replace"),  # temp file complete, not renamed
    "commit": ("sqlalchemy.orm.session", "SessionTransaction.commit"),  # index transaction not committed
    "unlink": ("pathlib", "Path.unlink"),  # committed, dropped chunk files not removed yet
}


def _ids(i: int) -> list[int]:
    # grows by 30 tokens a turn and starts over every 8 turns, so saves both add
    # chunks and drop them; the last token tags the turn that saved it
    return list(range(30 * (i % 8) + 10)) + [10_000 + i]


def _arm(trap: str, nth: int, signal_fd: int) -> None:
    """Make the ``nth`` call of the trap's target signal the parent, then block until killed."""
    import importlib

    mod_name, attr = TRAPS[trap]
    owner: object = importlib.import_module(mod_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    real = getattr(owner, name)
    write = os.write
    calls = 0

    def trapped(*a, **k):
        nonlocal calls
        calls += 1
        if calls == nth:
            write(signal_fd, b"!")
            threading.Event().wait()  # until SIGKILL
        return real(*a, **k)

    setattr(owner, name, trapped)


def _worker(home: str, trap: str, nth: int, signal_fd: int) -> None:
    try:
        st = Store(home)
        st.acquire_lease(SID, auto_renew=False, ttl_s=60)  # a dead holder must not block the next one
        st.open_session(SID, fingerprint=FP)
        i = st.get_session(SID).n_messages
        _arm(trap, nth, signal_fd)
        while True:
            st.append_message(SID, "user", f"m{i}")
            ids = _ids(i)
            st.save_kv(SID, token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
            i += 1
    finally:
        os._exit(0)


def _check(home: Path) -> tuple[int, DebrisReport]:
    """Assert the store is in a committed state; return its message count and what opening it removed."""
    with Store(home) as st:
        debris = st.debris_removed
        if not st.has_session(SID):
            return 0, debris
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
        # the open removed the dead worker's leftovers at once: nothing for gc, even without its grace
        assert not any(p.name.startswith(".tmp-") for p in (home / "kv").rglob("*")) if (home / "kv").exists() else True
        assert len(kv_files(home)) == st.disk_usage().n_chunks  # no orphans left, no dangling rows
        report = collect_garbage(st, dry_run=True, grace_s=0)
        assert (report.temp_files, report.orphan_files, report.dangling_chunks) == ([], [], [])
        return len(msgs), debris


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_kill_9_mid_save_never_leaves_a_torn_state(home: Path) -> None:
    ctx = mp.get_context("fork")
    rng = random.Random(20240611)
    Store(home).close()
    progress = []
    leftovers = []
    plan = [(trap, rng.randint(1, 12)) for _ in range(4) for trap in TRAPS]
    rng.shuffle(plan)
    for trap, nth in plan:
        r, w = os.pipe()
        p = ctx.Process(target=_worker, args=(str(home), trap, nth, w), daemon=True)
        p.start()
        os.close(w)  # the child's copy is the only writer: EOF means it died without firing
        ready, _, _ = select.select([r], [], [], 120)
        fired = os.read(r, 1) if ready else b""
        os.close(r)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        assert fired == b"!", f"the {trap} trap (call {nth}) never fired"
        assert p.exitcode == -signal.SIGKILL
        n, debris = _check(home)
        progress.append(n)
        leftovers.append(debris)
    # kills really landed mid-save, and the next open removed what they left: a dead
    # writer's temp file, a renamed but uncommitted file
    assert any(d.temp_files for d in leftovers) and any(d.chunk_files for d in leftovers)
    assert progress[-1] >= 5 and progress == sorted(progress)  # workers really saved between kills; history only grows


def _fire(ctx, home: Path, trap: str, nth: int):
    """Start a worker that blocks at ``trap``'s ``nth`` call mid-save; return the process once it is there."""
    r, w = os.pipe()
    p = ctx.Process(target=_worker, args=(str(home), trap, nth, w), daemon=True)
    p.start()
    os.close(w)
    ready, _, _ = select.select([r], [], [], 120)
    fired = os.read(r, 1) if ready else b""
    os.close(r)
    assert fired == b"!", f"the {trap} trap (call {nth}) never fired"
    return p


def _leftovers(home: Path, st: Store) -> tuple[list[Path], list[Path]]:
    """(temp files, chunk files no row names) under kv/."""
    indexed = {st.path_of(u.hash) for u in st.chunk_usage()}
    temps = [p for p in (home / "kv").rglob(".tmp-*")]
    return temps, [p for p in kv_files(home) if p not in indexed]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("trap, nth, kind", [
    ("rename", 1, "temp"),  # the chunk's temp file is complete, not renamed yet
    ("fsync", 3, "chunk"),  # renamed into place (its directory's fsync: the 3rd call in a fresh home), not committed
])
def test_debris_of_a_killed_save_is_removed_at_the_next_open_and_a_live_save_is_spared(
    home: Path, trap: str, nth: int, kind: str
) -> None:
    ctx = mp.get_context("fork")
    Store(home).close()
    p = _fire(ctx, home, trap, nth)
    try:
        with Store(home) as st:  # the writer is alive (blocked mid-save): its files are not debris
            assert st.debris_removed.files_removed == 0
            temps, orphans = _leftovers(home, st)
            assert (temps if kind == "temp" else orphans), "the save left nothing to look at"
            assert collect_garbage(st, dry_run=False).files_removed == 0  # default grace: a save in flight
            assert _leftovers(home, st) == (temps, orphans)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    with Store(home) as st:  # the writer is gone: what it left goes at once, no grace period
        removed = st.debris_removed
        assert (removed.temp_files if kind == "temp" else removed.chunk_files) == (temps if kind == "temp" else orphans)
        assert _leftovers(home, st) == ([], [])
        assert not list((home / "owners").glob("*.lock"))[1:]  # only this Store's own lock is left
        gc = collect_garbage(st, dry_run=True, grace_s=0)
        assert (gc.temp_files, gc.orphan_files) == ([], [])
