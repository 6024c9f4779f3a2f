from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from chatkv.storage import SessionLockedError, Store
from chatkv.storage.schema import LeaseRow, utcnow

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
        threading.Timer(0.3, a.release_lease, args=("s",)).start()
        t0 = time.monotonic()
        b.acquire_lease("s", timeout_s=5)
        assert 0.2 < time.monotonic() - t0 < 3
        with pytest.raises(SessionLockedError):
            a.acquire_lease("s", timeout_s=0.2)


def test_expired_lease_is_taken_over_and_renewal_keeps_it(home: Path) -> None:
    with Store(home) as a, Store(home) as b:
        lease = a.acquire_lease("s", ttl_s=0.3, auto_renew=False)
        time.sleep(0.4)
        b.acquire_lease("s", auto_renew=False)  # a stopped renewing: expired
        with pytest.raises(SessionLockedError):
            lease.renew()
        b.release_lease("s")
        kept = a.acquire_lease("s", ttl_s=0.3, auto_renew=True)  # renews every 0.1 s
        time.sleep(0.6)
        with pytest.raises(SessionLockedError):
            b.acquire_lease("s")
        kept.release()
        b.acquire_lease("s")


def test_lease_of_a_dead_process_is_taken_over_at_once(home: Path) -> None:
    import socket

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    with Store(home) as st:
        with st._session() as s, s.begin():
            s.add(LeaseRow(session_id="s", owner=f"{socket.gethostname()}:{p.pid}:deadbeef",
                           expires_at=utcnow() + timedelta(hours=1)))
        st.acquire_lease("s")  # no wait for the hour
        with st._session() as s:
            assert s.get(LeaseRow, "s").owner == st.owner


def test_close_releases_leases(home: Path) -> None:
    a = Store(home)
    a.acquire_lease("s")
    a.close()
    with Store(home) as b:
        b.acquire_lease("s")
