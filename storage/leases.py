"""Session leases: one owner at a time per session id, across processes and hosts.

A lease is a row (session id, owner, expiry). The holder renews it; a lease
past its expiry, or one held by a dead process on this host, may be taken
over. Owner ids are ``host:pid:random``.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from types import TracebackType

from sqlalchemy import delete
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from .errors import SessionLockedError
from .schema import LeaseRow, utcnow


def make_owner_id() -> str:
    """A fresh owner id: ``<hostname>:<pid>:<8 hex>``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _owner_is_dead(owner: str) -> bool:
    """True only when ``owner`` ran on this host and its process is gone."""
    try:
        host, pid_s, _ = owner.rsplit(":", 2)
        pid = int(pid_s)
    except ValueError:
        return False
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def foreign_holder(s: Session, session_id: str, owner: str) -> LeaseRow | None:
    """The live lease on ``session_id`` held by someone other than ``owner``, if any."""
    row = s.get(LeaseRow, session_id)
    if row is None or row.owner == owner:
        return None
    if row.expires_at <= utcnow() or _owner_is_dead(row.owner):
        return None
    return row


def check_not_locked(s: Session, session_id: str, owner: str) -> None:
    """Raise :class:`SessionLockedError` if another live owner holds ``session_id``."""
    row = foreign_holder(s, session_id, owner)
    if row is not None:
        raise SessionLockedError(session_id, row.owner, (row.expires_at - utcnow()).total_seconds())


def try_acquire(s: Session, session_id: str, owner: str, ttl_s: float) -> LeaseRow | None:
    """Take or renew the lease in the current transaction; the blocking holder on failure.

    Returns ``None`` on success (the row is added/updated in ``s``), else the
    foreign live lease that blocks.
    """
    now = utcnow()
    row = s.get(LeaseRow, session_id)
    if row is None:
        s.add(LeaseRow(session_id=session_id, owner=owner, acquired_at=now, renewed_at=now,
                       expires_at=now + timedelta(seconds=ttl_s)))
        return None
    if row.owner != owner and row.expires_at > now and not _owner_is_dead(row.owner):
        return row
    if row.owner != owner:
        row.owner = owner
        row.acquired_at = now
    row.renewed_at = now
    row.expires_at = now + timedelta(seconds=ttl_s)
    return None


class Lease(AbstractContextManager["Lease"]):
    """A held lease on one session. Release it with :meth:`release` or ``with``.

    With ``auto_renew`` a daemon thread renews it every ``ttl_s / 3`` seconds
    until released, so a long-idle holder keeps it.
    """

    def __init__(
        self,
        session_id: str,
        owner: str,
        ttl_s: float,
        session_factory: Callable[[], Session],
        auto_renew: bool,
    ) -> None:
        self.session_id = session_id
        self.owner = owner
        self.ttl_s = ttl_s
        self._factory = session_factory
        self._released = threading.Event()
        self._thread: threading.Thread | None = None
        if auto_renew:
            self._thread = threading.Thread(target=self._renew_loop, name=f"chatkv-lease-{session_id}", daemon=True)
            self._thread.start()

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return self._released.is_set()

    def renew(self) -> None:
        """Push the expiry to now + ttl.

        Raises:
            SessionLockedError: the lease expired and another owner took it.
        """
        with self._factory() as s, s.begin():
            blocker = try_acquire(s, self.session_id, self.owner, self.ttl_s)
            if blocker is not None:
                raise SessionLockedError(self.session_id, blocker.owner,
                                         (blocker.expires_at - utcnow()).total_seconds())

    def release(self) -> None:
        """Delete the lease row if this owner still holds it. Idempotent."""
        if self._released.is_set():
            return
        self._released.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._factory() as s, s.begin():
            s.execute(delete(LeaseRow).where(LeaseRow.session_id == self.session_id,
                                             LeaseRow.owner == self.owner))

    def _renew_loop(self) -> None:
        while not self._released.wait(self.ttl_s / 3):
            try:
                self.renew()
            except Exception:  # lost it or the index is unreachable; stop quietly
                return

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def acquire(
    session_factory: Callable[[], Session],
    session_id: str,
    owner: str,
    *,
    ttl_s: float,
    timeout_s: float,
    auto_renew: bool,
    poll_s: float = 0.05,
) -> Lease:
    """Acquire the lease on ``session_id`` for ``owner``, waiting up to ``timeout_s``.

    Raises:
        SessionLockedError: still held by another live owner after ``timeout_s``.
    """
    deadline = time.monotonic() + max(timeout_s, 0.0)
    while True:
        blocker: LeaseRow | None = None
        try:
            with session_factory() as s, s.begin():
                blocker = try_acquire(s, session_id, owner, ttl_s)
                if blocker is not None:
                    blocker = LeaseRow(session_id=blocker.session_id, owner=blocker.owner,
                                       expires_at=blocker.expires_at)
        except IntegrityError:  # someone inserted first; look again
            blocker = LeaseRow(session_id=session_id, owner="(racing owner)", expires_at=utcnow())
        if blocker is None:
            return Lease(session_id, owner, ttl_s, session_factory, auto_renew)
        if time.monotonic() >= deadline:
            raise SessionLockedError(session_id, blocker.owner, (blocker.expires_at - utcnow()).total_seconds())
        time.sleep(poll_s)
