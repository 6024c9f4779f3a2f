from __future__ import annotations

import logging
import subprocess
import sys
import threading
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from chatkv.storage import SessionLockedError, Store
from chatkv.storage.schema import LeaseRow, utcnow
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


def test_a_lost_lease_is_logged_by_its_renewal_thread(home: Path) -> None:
    failed = threading.Event()

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "renewal failed" in record.getMessage():
                failed.set()

    handler = Handler()
    logging.getLogger("chatkv.storage.leases").addHandler(handler)
    try:
        with Store(home) as a:
            lease = a.acquire_lease("s", ttl_s=0.3, auto_renew=True)
            with Store(home, clock=lambda: lease.expires_at + timedelta(hours=1)) as b:
                b.acquire_lease("s", auto_renew=False)  # takes it over while a still renews
                assert failed.wait(30)
                assert b.lease_holder("s") is None and a.lease_holder("s") == b.owner
    finally:
        logging.getLogger("chatkv.storage.leases").removeHandler(handler)


def test_lease_of_a_dead_process_is_taken_over_at_once(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    import socket

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead = f"{socket.gethostname()}:{p.pid}:deadbeef"
    with Store(home) as st:
        with Session(st.engine) as s, s.begin():
            s.add(LeaseRow(session_id="s", owner=dead, expires_at=utcnow() + timedelta(hours=1)))
        with caplog.at_level(logging.WARNING, logger="chatkv.storage.leases"):
            st.acquire_lease("s")  # no wait for the hour
        with Session(st.engine) as s:
            assert s.get(LeaseRow, "s").owner == st.owner
        assert any(dead in r.getMessage() and "taken over" in r.getMessage() for r in caplog.records)


def test_close_releases_leases(home: Path) -> None:
    a = Store(home)
    a.acquire_lease("s")
    a.close()
    with Store(home) as b:
        b.acquire_lease("s")
