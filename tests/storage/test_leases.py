from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from chatkv.storage import LeaseLostError, SessionLockedError, Store
from chatkv.storage.leases import fence, make_owner_id, owner_is_dead
from chatkv.storage.schema import LeaseRow, utcnow
from sqlalchemy import event, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from .conftest import FP, new_chunks


def test_second_owner_gets_a_clear_error_and_cannot_write(home: Path) -> None:
    with Store(home) as a, Store(home) as b:
        a.open_session("s", fingerprint=FP)
        a.acquire_lease("s", auto_renew=False)
        with pytest.raises(SessionLockedError, match=r"session 's' is in use by .*:\d+:") as ei:
            b.acquire_lease("s")
        assert ei.value.owner == a.owner and ei.value.expires_in_s > 0
        for write in (lambda: b.append_message("s", "user", "x"),
                      lambda: b.save_kv("s", token_ids=[1], fingerprint=FP, chunks=new_chunks([1])),
                      lambda: b.invalidate_kv("s"),
                      lambda: b.delete_session("s")):
            with pytest.raises(SessionLockedError):
                write()
        a.append_message("s", "user", "mine")  # the holder writes freely
        assert [m.content for m in b.messages("s")] == ["mine"]  # reading is never blocked
        a.release_lease("s")
        b.acquire_lease("s")
        b.append_message("s", "user", "now b")


def test_waiting_acquire_gets_the_lease_when_released(home: Path) -> None:
    with Store(home) as a, Store(home) as b:
        a.acquire_lease("s", auto_renew=False)
        waiting = threading.Event()
        seen: list[str] = []
        got: list[object] = []

        def wait_for_it() -> None:
            got.append(b.acquire_lease("s", timeout_s=60, on_wait=lambda holder: (seen.append(holder), waiting.set())))

        t = threading.Thread(target=wait_for_it)
        t.start()
        assert waiting.wait(30)  # b found the lease held and is waiting for it
        assert seen == [a.owner] and not got
        a.release_lease("s")
        t.join(30)
        assert not t.is_alive() and len(got) == 1 and a.lease_holder("s") == b.owner
        with pytest.raises(SessionLockedError):
            a.acquire_lease("s", timeout_s=0.2)


def test_expired_lease_is_taken_over(home: Path) -> None:
    with Store(home) as a:
        a.open_session("s")
        lease = a.acquire_lease("s", ttl_s=30, auto_renew=False)
        # b's clock reads one second past a's expiry: to b the lease has lapsed
        with Store(home, clock=lambda: lease.expires_at + timedelta(seconds=1)) as b:
            assert b.lease_holder("s") is None
            b.acquire_lease("s", auto_renew=False)  # a stopped renewing: expired
            with pytest.raises(SessionLockedError):
                lease.renew()  # to a, b's lease is live
            with pytest.raises(SessionLockedError):
                a.append_message("s", "user", "not mine any more")


def test_automatic_renewal_keeps_the_lease_past_an_earlier_expiry(home: Path) -> None:
    expiries: list[datetime] = []
    renewed_twice = threading.Event()

    def on_renew(lease) -> None:
        expiries.append(lease.expires_at)
        if len(expiries) == 2:
            renewed_twice.set()

    with Store(home) as a:
        kept = a.acquire_lease("s", ttl_s=0.3, auto_renew=True, on_renew=on_renew)  # renews every 0.1 s
        assert renewed_twice.wait(30)
        first, second = expiries[:2]
        assert second > first
        # A clock between the two expiries: had renewal stopped after the first, the lease would be free.
        between = first + (second - first) / 2
        with Store(home, clock=lambda: between) as b:
            with pytest.raises(SessionLockedError):
                b.acquire_lease("s")
            kept.release()
            b.acquire_lease("s")


def test_a_lost_lease_is_found_and_logged_by_its_renewal_thread(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    lost = threading.Event()
    errors: list[LeaseLostError] = []
    with caplog.at_level(logging.WARNING, logger="chatkv.storage.leases"), Store(home) as a:
        lease = a.acquire_lease("s", ttl_s=0.3, auto_renew=True, on_lost=lambda e: (errors.append(e), lost.set()))
        with Store(home, clock=lambda: lease.expires_at + timedelta(hours=1)) as b:
            taken = b.acquire_lease("s", auto_renew=False)  # takes it over while a still renews
            assert lost.wait(30)
            assert lease.lost and errors[0].owner == b.owner and errors[0].generation == lease.generation
            assert errors[0].holder_generation == taken.generation > lease.generation
            assert b.lease_holder("s") is None and a.lease_holder("s") == b.owner
    assert any("lost the lease" in r.getMessage() for r in caplog.records)


def _owner_of_a_finished_process() -> str:
    """The owner id a real process made for itself, after that process exited (and was reaped)."""
    code = "from chatkv.storage.leases import make_owner_id; print(make_owner_id())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def _plant_lease(st: Store, owner: str, *, expires_in_s: float = 3600) -> None:
    with Session(st.engine) as s, s.begin():
        s.add(LeaseRow(session_id="s", owner=owner, generation=7, acquired_at=utcnow(), renewed_at=utcnow(),
                       expires_at=utcnow() + timedelta(seconds=expires_in_s)))


def test_lease_of_a_dead_process_is_taken_over_at_once(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead = _owner_of_a_finished_process()
    with Store(home) as st:
        _plant_lease(st, dead)
        with caplog.at_level(logging.WARNING, logger="chatkv.storage.leases"):
            lease = st.acquire_lease("s")  # no wait for the hour
        assert lease.generation == 8  # the takeover bumped the fencing token
        with Session(st.engine) as s:
            assert s.get(LeaseRow, "s").owner == st.owner
        assert any(dead in r.getMessage() and "taken over" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("where", ["another PID namespace", "another machine", "an id without a place"])
def test_a_dead_looking_pid_elsewhere_is_waited_out_not_taken_over(home: Path, where: str) -> None:
    # The pid of a finished process, as a holder in another container (same
    # hostname, its own PID namespace) or on another machine would record it:
    # here that pid is free, but over there it may well be a live holder.
    host, pid, rand, place = _owner_of_a_finished_process().split(":")
    ns, start = place.split(".")
    owner = {"another PID namespace": f"{host}:{pid}:{rand}:{'0' * 16}.{start}",
             "another machine": f"elsewhere:{pid}:{rand}:{'f' * 16}.{start}",
             "an id without a place": f"{host}:{pid}:{rand}"}[where]
    with Store(home) as st:
        _plant_lease(st, owner, expires_in_s=60)
        with pytest.raises(SessionLockedError) as ei:
            st.acquire_lease("s")
        assert ei.value.owner == owner
        with pytest.raises(SessionLockedError):
            st.open_session("s")  # creating it is a write under the lease
    later = utcnow() + timedelta(seconds=61)
    with Store(home, clock=lambda: later) as st:
        assert st.acquire_lease("s", auto_renew=False).generation == 8  # once it expired


def test_a_reused_pid_or_a_zombie_does_not_keep_a_dead_holder_alive(home: Path) -> None:
    # Same kernel and namespace as us, the pid is alive, but not the process
    # that made the id: the start time differs (the pid was reused).
    me = make_owner_id()
    host, pid, rand, place = me.split(":")
    ns, start = place.split(".")
    assert not owner_is_dead(me)  # this very process
    parent = os.getppid()
    assert not owner_is_dead(f"{host}:{parent}:{rand}:{ns}.{_start_of(parent)}")  # a live process
    assert owner_is_dead(f"{host}:{parent}:{rand}:{ns}.{int(_start_of(parent)) + 1}")  # its pid, reused
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        while _state_of(zombie.pid) != "Z":  # exited, not reaped yet
            os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)
        assert owner_is_dead(f"{host}:{zombie.pid}:{rand}:{ns}.{_start_of(zombie.pid)}")
    finally:
        zombie.wait()


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def _start_of(pid: int) -> str:
    return _stat(pid)[19]


def _state_of(pid: int) -> str:
    return _stat(pid)[0]


# ----------------------------------------------------------------------------- fencing

def test_a_holder_that_lost_its_lease_can_never_write_again(home: Path) -> None:
    with Store(home) as a:
        a.open_session("s", fingerprint=FP)
        lease = a.acquire_lease("s", ttl_s=30, auto_renew=False)
        a.append_message("s", "user", "a1")
        with Store(home, clock=lambda: lease.expires_at + timedelta(seconds=1)) as b:
            taken = b.acquire_lease("s", auto_renew=False)
            assert taken.generation == lease.generation + 1
            b.append_message("s", "user", "b1")
            for write in (lambda: a.append_message("s", "user", "a2"),
                          lambda: a.rewrite_history("s", 0, [("system", "forged", None, False)]),
                          lambda: a.truncate_history("s", 0),
                          lambda: a.save_kv("s", token_ids=[1], fingerprint=FP, chunks=new_chunks([1])),
                          lambda: a.invalidate_kv("s"),
                          lambda: a.mark_kv_verified("s"),
                          lambda: a.touch("s", tier="device"),
                          lambda: a.delete_session("s")):
                with pytest.raises(LeaseLostError) as ei:
                    write()
                assert ei.value.owner == b.owner and ei.value.generation == lease.generation
            assert lease.lost
            with pytest.raises(LeaseLostError):
                lease.renew()
            b.release_lease("s")  # nobody holds it now: a, still, must not write
            with pytest.raises(LeaseLostError):
                a.append_message("s", "user", "a3")
            with pytest.raises(LeaseLostError):
                lease.renew()  # and renewal never takes a free lease back
            assert b.lease_holder("s") is None
            assert [m.content for m in b.messages("s")] == ["a1", "b1"]
            assert b.cached_token_ids("s") == []
        a.release_lease("s")  # forgetting the lost lease: a may now write as anyone who holds none
        a.append_message("s", "user", "a4, as a newcomer")


def test_a_stale_token_is_refused_inside_the_write_transaction(home: Path) -> None:
    """The fence is an UPDATE conditional on (owner, generation), in the write's own transaction."""
    with Store(home) as a:
        a.open_session("s")
        lease = a.acquire_lease("s", auto_renew=False)
        with Session(a.engine) as s, s.begin():  # someone bumps the generation behind a's back
            s.execute(update(LeaseRow).where(LeaseRow.session_id == "s").values(generation=LeaseRow.generation + 1))
        with pytest.raises(LeaseLostError):
            a.append_messages("s", [("user", "one", None, False), ("assistant", "two", None, False)])
        assert a.messages("s") == []  # nothing of the refused write committed
        with Session(a.engine) as s, s.begin():
            with pytest.raises(LeaseLostError):
                fence(s, lease)


def test_generations_grow_across_holders_and_releases(home: Path) -> None:
    with Store(home) as a, Store(home) as b:
        a.open_session("s")
        gens = []
        for st in (a, b, a, a, b):
            lease = st.acquire_lease("s", auto_renew=False)
            gens.append(lease.generation)
            st.append_message("s", "user", f"gen {lease.generation}")
            st.release_lease("s")
        assert gens == [1, 2, 3, 4, 5]
        lease.renew()  # a released lease is never brought back by a renewal
        with Session(a.engine) as s:
            row = s.get(LeaseRow, "s")
            assert row.generation == 5 and row.expires_at < utcnow()  # kept, marked released


def test_an_expired_lease_nobody_took_is_still_its_holders(home: Path) -> None:
    with Store(home) as a:
        a.open_session("s")
        lease = a.acquire_lease("s", ttl_s=30, auto_renew=False)
        a.append_message("s", "user", "in time")
        with Session(a.engine) as s, s.begin():  # it lapses (a was cut off); nobody takes it
            s.execute(update(LeaseRow).where(LeaseRow.session_id == "s").values(expires_at=utcnow()))
        a.append_message("s", "user", "late but unchallenged")  # the token still matches
        lease.renew()
        assert not lease.lost and [m.content for m in a.messages("s")] == ["in time", "late but unchallenged"]


def test_renewal_survives_a_transient_index_failure(home: Path) -> None:
    failures = threading.Event()
    renewed_after = threading.Event()
    state = {"failed": 0}

    def fail(conn, cursor, statement, *args):
        if statement.lstrip().upper().startswith("UPDATE CHATKV_LEASES SET RENEWED_AT") and state["failed"] < 3:
            state["failed"] += 1
            if state["failed"] == 3:
                failures.set()
            raise OperationalError(statement, (), Exception("database or disk is full"))

    def on_renew(lease) -> None:
        if failures.is_set():
            renewed_after.set()

    with Store(home) as a:
        event.listen(a.engine, "before_cursor_execute", fail)
        try:
            lease = a.acquire_lease("s", ttl_s=0.3, auto_renew=True, on_renew=on_renew)
            assert renewed_after.wait(30)  # three failed renewals in a row, then it renewed again
        finally:
            event.remove(a.engine, "before_cursor_execute", fail)
        assert state["failed"] == 3 and not lease.lost and not lease.released
        a.open_session("s")
        a.append_message("s", "user", "still mine")
        at = lease.expires_at - timedelta(seconds=0.01)
        with Store(home, clock=lambda: at) as b:
            with pytest.raises(SessionLockedError):
                b.acquire_lease("s")


def test_a_paused_holder_cannot_write_after_its_successor_took_over(home: Path) -> None:
    """A real process holds the lease, is stopped (SIGSTOP) until its lease
    expires and another owner takes the session, then resumes (SIGCONT)."""
    child = subprocess.Popen([sys.executable, "-c", PAUSED_HOLDER, str(home), "1.5"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert _reply(child) == "ready"
        assert _line(child) == "renewed"  # a renewal just committed: the next is 0.5 s away
        os.kill(child.pid, signal.SIGSTOP)
        try:
            with Store(home) as b:
                taken = b.acquire_lease("s", timeout_s=120, auto_renew=False)  # waits out the expiry
                b.append_message("s", "assistant", "from the successor")
        finally:
            os.kill(child.pid, signal.SIGCONT)
        for cmd in ("ensure", "write", "renew", "write"):
            child.stdin.write(cmd + "\n")
            child.stdin.flush()
            assert _reply(child).split()[:2] == ["lost", str(taken.generation - 1)], cmd
        child.stdin.write("close\n")
        child.stdin.flush()
        assert _reply(child) == "closed"
        assert child.wait(60) == 0, child.stderr.read()[-3000:]
        with Store(home) as c:
            assert [m.content for m in c.messages("s")] == ["from the first holder", "from the successor"]
            with Session(c.engine) as s:
                row = s.get(LeaseRow, "s")
                assert (row.owner, row.generation) == (taken.owner, taken.generation)  # the child's close left it
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


PAUSED_HOLDER = """
import sys
from chatkv.storage import LeaseLostError, Store
st = Store(sys.argv[1], lease_ttl_s=float(sys.argv[2]))
lease = st.acquire_lease("s", on_renew=lambda lease: print("renewed", flush=True))
st.open_session("s")
st.append_message("s", "user", "from the first holder")
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "close":
        st.close()
        print("closed", flush=True)
        break
    try:
        {"write": lambda: st.append_message("s", "user", "from the paused holder"),
         "renew": lease.renew, "ensure": lease.ensure}[cmd]()
        print("ok", flush=True)
    except LeaseLostError as e:
        print("lost", e.generation, e.owner, flush=True)
"""


def _line(child: subprocess.Popen) -> str:
    line = child.stdout.readline()
    assert line, child.stderr.read()[-3000:]
    return line.strip()


def _reply(child: subprocess.Popen) -> str:
    """The next line that is not a renewal notice."""
    while True:
        line = _line(child)
        if line != "renewed":
            return line


def test_close_releases_leases(home: Path) -> None:
    a = Store(home)
    a.acquire_lease("s")
    a.close()
    with Store(home) as b:
        b.acquire_lease("s")


def test_open_leased_reads_what_the_lease_found_in_its_transaction(home: Path) -> None:
    with Store(home) as a, Store(home) as b:
        new = a.open_leased("s", fingerprint=FP, system_prompt="Be brief.")
        assert new.info.n_cached == 0 and new.info.system_prompt == "Be brief." and new.messages == []
        assert new.kv is None and new.lease.generation == 1
        with pytest.raises(SessionLockedError):
            b.open_leased("s", fingerprint=FP)
        a.append_message("s", "user", "hi")
        ids = list(range(40))
        a.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
        a.release_lease("s")
        back = b.open_leased("s", fingerprint=FP)
        assert back.lease.generation == 2 and [m.content for m in back.messages] == ["hi"]
        assert back.info.n_cached == 40 and back.kv is not None and back.kv.token_ids == ids
        assert [c.hash for c in back.kv.chunks] == [c.hash for c in a.kv_chunks("s")]
        with pytest.raises(SessionLockedError):  # b holds it now, through the Store
            a.append_message("s", "user", "not mine")
        b.release_lease("s")
        other = a.open_leased("s", fingerprint="another-model")
        assert other.info.n_cached == 40 and other.kv is None  # another model's KV is not offered


def test_a_failure_inside_the_leasing_transaction_takes_nothing(home: Path) -> None:
    with Store(home) as a, Store(home) as b:
        def fail(s: Session) -> None:
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            a.acquire_lease("s", within=fail)
        assert a.lease_holder("s") is None and b.lease_holder("s") is None
        assert not a.has_session("s")
        b.open_leased("s", fingerprint=FP)  # free for anyone
        assert a.lease_holder("s") == b.owner
