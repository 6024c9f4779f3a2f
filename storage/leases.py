"""Session leases: one owner at a time per session id, across processes and hosts.

A lease is a row (session id, owner, expiry). The holder renews it; a lease
past its expiry, or one held by a dead process on this host, may be taken
over. Owner ids are ``host:pid:random``.

Expiry is judged by a clock (a callable returning aware UTC ``datetime``;
default :func:`~.schema.utcnow`) that callers may inject, so tests decide
when a lease has expired instead of sleeping past it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from types import TracebackType

from sqlalchemy import delete
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from .errors import SessionLockedError
from .schema import LeaseRow, utcnow

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
"""Returns the current time, timezone-aware UTC."""


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


def foreign_holder(s: Session, session_id: str, owner: str, now: datetime | None = None) -> LeaseRow | None:
    """The live lease on ``session_id`` held by someone other than ``owner``, if any.

    A lease is live if it expires after ``now`` (default: the current time)
    and its owner is not a dead process on this host.
    """
    row = s.get(LeaseRow, session_id)
    if row is None or row.owner == owner:
        return None
    if row.expires_at <= (now or utcnow()) or _owner_is_dead(row.owner):
        return None
    return row


def check_not_locked(s: Session, session_id: str, owner: str, now: datetime | None = None) -> None:
    """Raise :class:`SessionLockedError` if another live owner holds ``session_id`` at ``now``."""
    now = now or utcnow()
    row = foreign_holder(s, session_id, owner, now)
    if row is not None:
        raise SessionLockedError(session_id, row.owner, (row.expires_at - now).total_seconds())


def try_acquire(s: Session, session_id: str, owner: str, ttl_s: float,
                now: datetime | None = None) -> LeaseRow | None:
    """Take or renew the lease in the current transaction; the blocking holder on failure.

    Returns ``None`` on success (the row is added/updated in ``s``, expiring at
    ``now + ttl_s``), else the foreign live lease that blocks. Taking over an
    expired lease or a dead process's lease is logged.
    """
    now = now or utcnow()
    row = s.get(LeaseRow, session_id)
    if row is None:
        s.add(LeaseRow(session_id=session_id, owner=owner, acquired_at=now, renewed_at=now,
                       expires_at=now + timedelta(seconds=ttl_s)))
        return None
    if row.owner != owner:
        if row.expires_at > now and not _owner_is_dead(row.owner):
            return row
        why = "its process is gone" if row.expires_at > now else "it expired"
        log.warning("lease on session %r taken over from %s (%s)", session_id, row.owner, why)
        row.owner = owner
        row.acquired_at = now
    row.renewed_at = now
    row.expires_at = now + timedelta(seconds=ttl_s)
    return None


class Lease(AbstractContextManager["Lease"]):
    """A held lease on one session. Release it with :meth:`release` or ``with``.

    With ``auto_renew`` a daemon thread renews it every ``ttl_s / 3`` seconds
    until released, so a long-idle holder keeps it. If a renewal fails (the
    lease was taken over, or the index is unreachable) the failure is logged
    and renewing stops; the next write then meets :class:`SessionLockedError`
    if another owner holds the session.

    Args:
        clock: judges expiry (default :func:`~.schema.utcnow`).
        expires_at: the expiry the acquiring transaction wrote.
        on_renew: called with the lease after each successful automatic renewal
            (tests wait on it; keep it cheap, it runs on the renewal thread).
    """

    def __init__(
        self,
        session_id: str,
        owner: str,
        ttl_s: float,
        session_factory: Callable[[], Session],
        auto_renew: bool,
        *,
        clock: Clock = utcnow,
        expires_at: datetime | None = None,
        on_renew: Callable[[Lease], None] | None = None,
    ) -> None:
        self.session_id = session_id
        self.owner = owner
        self.ttl_s = ttl_s
        self._factory = session_factory
        self._clock = clock
        self._expires_at = expires_at or clock() + timedelta(seconds=ttl_s)
        self._on_renew = on_renew
        self._released = threading.Event()
        self._thread: threading.Thread | None = None
        if auto_renew:
            self._thread = threading.Thread(target=self._renew_loop, name=f"chatkv-lease-{session_id}", daemon=True)
            self._thread.start()

    @property
    def released(self) -> bool:
        """True once :meth:`release` (or :meth:`detach`) ran."""
        return self._released.is_set()

    @property
    def expires_at(self) -> datetime:
        """When the lease lapses unless renewed (as of this holder's last acquire or renewal)."""
        return self._expires_at

    def renew(self) -> None:
        """Push the expiry to now + ttl.

        Raises:
            SessionLockedError: the lease expired and another owner took it.
        """
        now = self._clock()
        with self._factory() as s, s.begin():
            blocker = try_acquire(s, self.session_id, self.owner, self.ttl_s, now)
            if blocker is not None:
                raise SessionLockedError(self.session_id, blocker.owner, (blocker.expires_at - now).total_seconds())
        self._expires_at = now + timedelta(seconds=self.ttl_s)

    def release(self) -> None:
        """Delete the lease row if this owner still holds it. Idempotent."""
        if self._released.is_set():
            return
        self.detach()
        with self._factory() as s, s.begin():
            s.execute(delete(LeaseRow).where(LeaseRow.session_id == self.session_id,
                                             LeaseRow.owner == self.owner))

    def detach(self) -> None:
        """Stop renewing and mark the lease released without touching its row.

        For when the row is already gone (the session was deleted along with
        its lease in one transaction). Idempotent.
        """
        self._released.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _renew_loop(self) -> None:
        while not self._released.wait(self.ttl_s / 3):
            try:
                self.renew()
            except Exception as e:  # lost it, or the index is unreachable: nothing left to renew
                if not self._released.is_set():
                    log.warning("lease on session %r: renewal failed, no longer renewing: %s", self.session_id, e)
                return
            if self._on_renew is not None:
                self._on_renew(self)

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
    clock: Clock = utcnow,
    on_wait: Callable[[str], None] | None = None,
    on_renew: Callable[[Lease], None] | None = None,
) -> Lease:
    """Acquire the lease on ``session_id`` for ``owner``, waiting up to ``timeout_s``.

    Args:
        clock: judges whether a held lease has expired (default :func:`~.schema.utcnow`).
        on_wait: called once, with the blocking owner's id, when the first
            attempt finds the lease held and the call starts waiting.
        on_renew: passed to the :class:`Lease`.

    Raises:
        SessionLockedError: still held by another live owner after ``timeout_s``.
    """
    deadline = time.monotonic() + max(timeout_s, 0.0)
    waiting = False
    while True:
        blocker: LeaseRow | None = None
        now = clock()
        try:
            with session_factory() as s, s.begin():
                blocker = try_acquire(s, session_id, owner, ttl_s, now)
                if blocker is not None:
                    blocker = LeaseRow(session_id=blocker.session_id, owner=blocker.owner,
                                       expires_at=blocker.expires_at)
        except IntegrityError:  # someone inserted first; look again
            blocker = LeaseRow(session_id=session_id, owner="(racing owner)", expires_at=now)
        if blocker is None:
            return Lease(session_id, owner, ttl_s, session_factory, auto_renew, clock=clock,
                         expires_at=now + timedelta(seconds=ttl_s), on_renew=on_renew)
        if time.monotonic() >= deadline:
            raise SessionLockedError(session_id, blocker.owner, (blocker.expires_at - now).total_seconds())
        if not waiting:
            waiting = True
            if on_wait is not None:
                on_wait(blocker.owner)
        time.sleep(poll_s)
