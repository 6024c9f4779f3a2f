"""Session leases: one writer at a time per session id, across processes and machines.

A lease is a row of ``chatkv_leases``: session id, owner id, a *generation*
and an expiry. Everything that changes it is one transaction whose UPDATE is
conditional on the row as it was read, so it holds on any SQL backend
(SQLite, PostgreSQL across machines); nothing relies on a file lock or a
process table that another machine cannot see.

- **Taking it.** A missing row is inserted (generation 1; a racing insert
  fails on the primary key and the caller looks again). A row that is
  released, expired (by the caller's clock) or held by a *provably* dead
  process is taken over by ``UPDATE ... WHERE owner = <as read> AND
  generation = <as read>``, which sets the new owner and bumps the
  generation; zero rows updated means someone else won, and the caller
  looks again. Every acquire bumps the generation, so it grows across
  holders.
- **Fencing.** The generation is the holder's fencing token. Every write a
  holder makes to its session first runs :func:`fence` in the write's own
  transaction: an UPDATE of the lease row conditional on (owner,
  generation). Zero rows means the lease was taken over (or the session
  deleted): the write is refused with :class:`LeaseLostError` and nothing of
  it commits. The UPDATE also locks the row until the write commits
  (PostgreSQL), or the write holds the database's write lock
  (SQLite, ``BEGIN IMMEDIATE``), so a takeover is ordered either before the
  write (which then fails) or after it (and the new holder reads it).
  Expiry alone never blocks a holder's write: an expired lease nobody took
  is still its holder's, and one somebody took has a new generation.
- **Renewal.** A daemon thread pushes the expiry forward every ``ttl / 3``
  with a conditional UPDATE. A failure of the database (full disk, a
  restart) is retried with exponential backoff, never given up; finding the
  row taken over marks the lease lost (:attr:`Lease.lost`), calls
  ``on_lost`` and stops. The holder's next write, and its next turn
  (:meth:`Lease.ensure`), then raise :class:`LeaseLostError`.
- **Releasing** keeps the row, marked released (it expired at the epoch), so
  the next holder's generation is still larger; deleting a session deletes
  its lease row with it.

**Owner ids** are ``host:pid:random:place``, where ``place`` names the kernel
and PID namespace the holder ran in (a hash of ``/proc/sys/kernel/random/boot_id``
and the inode of ``/proc/self/ns/pid``) and its process start time. A held
lease is taken before its expiry only when its holder is provably gone: the
same place as the caller (so the pid means the same process) and that pid no
longer running, or running with another start time (the pid was reused), or a
zombie. A holder in another container, on another machine or from an older
chatkv (an id without a place) is never judged by its pid: its lease is
waited out until it expires.

Expiry is judged by a clock (a callable returning aware UTC ``datetime``;
default :func:`~.schema.utcnow`) that callers may inject, so tests decide
when a lease has expired instead of sleeping past it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from types import TracebackType

from sqlalchemy import bindparam, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from .errors import LeaseLostError, SessionLockedError
from .schema import LeaseRow, utcnow

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
"""Returns the current time, timezone-aware UTC."""

#: The expiry a released lease is given: long past, by any clock.
RELEASED_AT = datetime(1970, 1, 1, tzinfo=timezone.utc)

#: First wait before retrying a failed renewal; doubled per failure, capped at the renewal interval.
RENEW_RETRY_S = 0.05


# ----------------------------------------------------------------------------- holder identity

def _proc_stat(pid: int | str) -> tuple[int, str, str] | None:
    """``(pid, state, start time in clock ticks)`` from ``/proc/<pid>/stat``, or None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    head, _, rest = raw.rpartition(")")  # the command name may hold spaces and parentheses
    fields = rest.split()
    try:
        return int(head.split(" ", 1)[0]), fields[0], fields[19]
    except (ValueError, IndexError):
        return None


_NS_CACHE: tuple[int, str | None] | None = None


def _namespace_id() -> str | None:
    """A hash naming this kernel boot and this process's PID namespace, or None
    where that cannot be established (no ``/proc``, or a ``/proc`` mounted for
    another PID namespace). Computed once per process (a forked child
    computes its own)."""
    global _NS_CACHE
    pid = os.getpid()
    if _NS_CACHE is None or _NS_CACHE[0] != pid:
        _NS_CACHE = (pid, _read_namespace_id())
    return _NS_CACHE[1]


def _read_namespace_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    me = _proc_stat("self")
    if not boot or me is None or me[0] != os.getpid():
        return None  # /proc does not show this PID namespace: pids in it would not be ours
    return hashlib.sha256(b"%s:%d:%d" % (boot, ns.st_dev, ns.st_ino)).hexdigest()[:16]


def make_owner_id() -> str:
    """A fresh owner id, unique per call: ``<hostname>:<pid>:<8 hex>:<place>``.

    ``place`` is ``<namespace hash>.<process start time>`` (see the module
    docstring); where it cannot be established the id ends after the random
    part, and this holder's lease can then only lapse by expiry.
    """
    base = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    ns = _namespace_id()
    me = _proc_stat("self")
    return f"{base}:{ns}.{me[2]}" if ns and me else base


def owner_is_dead(owner: str) -> bool:
    """True only when ``owner`` provably ran in this kernel and PID namespace and its process is gone.

    Gone means: no process has its pid, or the one that has it started at
    another time (the pid was reused), or it is a zombie. Any doubt (another
    machine, another container, an id without a place, an unreadable
    ``/proc``) answers False: the lease is then waited out until its expiry.
    """
    parts = owner.rsplit(":", 3)
    if len(parts) != 4:
        return False
    _, pid_s, _, place = parts
    ns, _, started = place.partition(".")
    here = _namespace_id()
    if not ns or here is None or ns != here:
        return False
    try:
        pid = int(pid_s)
    except ValueError:
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, under another user
    except OSError:
        return False
    stat = _proc_stat(pid)
    if stat is None:
        return False
    _, state, now_started = stat
    return state in ("Z", "X") or (bool(started) and now_started != started)


# ----------------------------------------------------------------------------- rows

@dataclass(frozen=True)
class Holder:
    """A lease row as read: who holds it, under which generation, until when."""

    owner: str
    generation: int
    expires_at: datetime

    @property
    def released(self) -> bool:
        """The holder let it go (:meth:`Lease.release`)."""
        return self.expires_at <= RELEASED_AT


# The statements of taking and fencing a lease, built once over the table's
# columns and run on the transaction's connection: the ORM's statement
# construction, cache key and execution layers cost more than SQLite's own work
# here (every open takes a lease; every write of a session checks it).
_LEASES = LeaseRow.__table__
_HOLDER = (select(_LEASES.c.owner, _LEASES.c.generation, _LEASES.c.expires_at)
           .where(_LEASES.c.session_id == bindparam("sid")))
#: The owner and expiry only: a read-only Store on an index older than the generation column asks this.
_OWNER = select(_LEASES.c.owner, _LEASES.c.expires_at).where(_LEASES.c.session_id == bindparam("sid"))
# (Parameters are not named after columns: an UPDATE reserves those names.)
_HELD = (_LEASES.c.session_id == bindparam("sid"), _LEASES.c.owner == bindparam("holder"),
         _LEASES.c.generation == bindparam("held_gen"))
_TAKE = update(_LEASES).where(*_HELD).values(owner=bindparam("taker"), generation=bindparam("new_gen"),
                                              acquired_at=bindparam("now"), renewed_at=bindparam("now"),
                                              expires_at=bindparam("expires"))
_FENCE = update(_LEASES).where(*_HELD).values(generation=_LEASES.c.generation)
_RENEW = update(_LEASES).where(*_HELD).values(renewed_at=bindparam("now"), expires_at=bindparam("expires"))
_RELEASE = update(_LEASES).where(*_HELD).values(expires_at=bindparam("released_at"))


def read_holder(s: Session, session_id: str) -> Holder | None:
    """The lease row on ``session_id``, if any (whether live, expired or released)."""
    row = s.connection().execute(_HOLDER, {"sid": session_id}).first()
    return Holder(row[0], int(row[1] or 0), row[2]) if row is not None else None


def _live(h: Holder, now: datetime) -> bool:
    return h.expires_at > now and not owner_is_dead(h.owner)


def foreign_holder(s: Session, session_id: str, owner: str, now: datetime | None = None) -> Holder | None:
    """The live lease on ``session_id`` held by someone other than ``owner``, if any.

    A lease is live if it expires after ``now`` (default: the current time)
    and its owner is not provably dead (:func:`owner_is_dead`). Reads the
    owner and expiry only (so a read-only Store on an older schema can ask);
    changes nothing. The returned holder's ``generation`` is 0 (not read).
    """
    row = s.connection().execute(_OWNER, {"sid": session_id}).first()
    if row is None:
        return None
    h = Holder(row[0], 0, row[1])
    if h.owner == owner or not _live(h, now or utcnow()):
        return None
    return h


def check_not_locked(s: Session, session_id: str, owner: str, now: datetime | None = None) -> None:
    """Raise :class:`SessionLockedError` if another live owner holds ``session_id`` at ``now``.

    For writers that hold no lease (the CLI's ``sessions rm``, gc): they may
    write a session nobody is using.
    """
    now = now or utcnow()
    h = foreign_holder(s, session_id, owner, now)
    if h is not None:
        raise SessionLockedError(session_id, h.owner, (h.expires_at - now).total_seconds())


def try_acquire(s: Session, session_id: str, owner: str, ttl_s: float,
                now: datetime | None = None) -> tuple[int | None, Holder | None]:
    """Take the lease in the current transaction: ``(generation, None)`` on success,
    ``(None, blocker)`` if a live foreign holder has it, ``(None, None)`` if a
    concurrent taker changed the row between the read and the update (look again).

    The row is inserted, or updated conditionally on the owner and generation
    it was read with; either way the new generation is one more than the
    row's (1 for a new row) and the expiry is ``now + ttl_s``. Taking over an
    expired or a dead process's lease is logged. A racing insert raises
    :class:`~sqlalchemy.exc.IntegrityError` at commit or flush.
    """
    now = now or utcnow()
    expires = now + timedelta(seconds=ttl_s)
    h = read_holder(s, session_id)
    if h is None:
        s.add(LeaseRow(session_id=session_id, owner=owner, generation=1, acquired_at=now,
                       renewed_at=now, expires_at=expires))
        s.flush()
        return 1, None
    if h.owner != owner and not h.released:
        if h.expires_at > now and not owner_is_dead(h.owner):
            return None, h
        why = "it expired" if h.expires_at <= now else "its process is gone"
        log.warning("lease on session %r taken over from %s (%s)", session_id, h.owner, why)
    gen = h.generation + 1
    if take_row(s, session_id, h, owner, gen, now, expires) != 1:
        return None, None
    return gen, None


def take_row(s: Session, session_id: str, h: Holder, owner: str, gen: int, now: datetime,
             expires: datetime) -> int:
    """Give the lease row on ``session_id`` to ``owner`` with generation ``gen``,
    if it still has ``h``'s owner and generation; returns the rows changed (0 or 1)."""
    res = s.connection().execute(_TAKE, {"sid": session_id, "holder": h.owner, "held_gen": h.generation,
                                          "taker": owner, "new_gen": gen, "now": now, "expires": expires})
    return int(res.rowcount)


def _lost_error(s: Session, lease: "Lease") -> LeaseLostError:
    h = read_holder(s, lease.session_id)
    holder = None if h is None or h.released else h.owner
    return LeaseLostError(lease.session_id, lease.owner, lease.generation, holder,
                          h.generation if h is not None else None)


def fence(s: Session, lease: "Lease") -> None:
    """Check, inside a write's transaction, that ``lease`` still holds its session.

    Runs an UPDATE of the lease row conditional on the lease's owner and
    generation (its fencing token), which also orders the write against any
    takeover (the row stays locked until the transaction ends). The write
    must come after this call in the same transaction.

    Raises:
        LeaseLostError: the lease is lost (marked so on ``lease``, ``on_lost``
            called): another owner took it over, or its row is gone.
    """
    if lease.lost:
        raise lease.lost_error()
    res = s.connection().execute(_FENCE, lease._held)
    if res.rowcount != 1:
        err = _lost_error(s, lease)
        lease._mark_lost(err)
        raise err


# ----------------------------------------------------------------------------- the holder's handle

class Lease(AbstractContextManager["Lease"]):
    """A held lease on one session. Release it with :meth:`release` or ``with``.

    With ``auto_renew`` a daemon thread renews it every ``ttl_s / 3``
    seconds until released. A renewal that fails because the index is
    unreachable or failing is retried with exponential backoff (from
    :data:`RENEW_RETRY_S` up to the renewal interval) until it succeeds; one
    that finds the lease taken over marks it :attr:`lost` and stops. A lost
    lease never comes back: every later write fenced by it raises
    :class:`LeaseLostError`.

    Args:
        generation: the fencing token the acquiring transaction wrote.
        clock: judges expiry (default :func:`~.schema.utcnow`).
        expires_at: the expiry the acquiring transaction wrote.
        on_renew: called with the lease after each successful automatic renewal
            (tests wait on it; keep it cheap, it runs on the renewal thread).
        on_lost: called once with the :class:`LeaseLostError` when the loss is
            found (by renewal or by a fenced write), on that thread.
    """

    def __init__(
        self,
        session_id: str,
        owner: str,
        ttl_s: float,
        session_factory: Callable[[], Session],
        auto_renew: bool,
        *,
        generation: int = 0,
        clock: Clock = utcnow,
        expires_at: datetime | None = None,
        on_renew: Callable[[Lease], None] | None = None,
        on_lost: Callable[[LeaseLostError], None] | None = None,
    ) -> None:
        self.session_id = session_id
        self.owner = owner
        self.generation = generation
        """The fencing token: the lease row's generation when this holder took it."""
        self.ttl_s = ttl_s
        self._factory = session_factory
        self._clock = clock
        self._expires_at = expires_at or clock() + timedelta(seconds=ttl_s)
        self._on_renew = on_renew
        self._on_lost = on_lost
        self._lost: LeaseLostError | None = None
        self._mu = threading.Lock()
        self._io = threading.Lock()  # orders renewals before a release's UPDATE
        self._released = threading.Event()
        self._thread: threading.Thread | None = None
        if auto_renew:
            self._thread = threading.Thread(target=self._renew_loop, name=f"chatkv-lease-{session_id}", daemon=True)
            self._thread.start()

    @property
    def _held(self) -> dict[str, object]:
        """The parameters of the statements conditional on holding this lease."""
        return {"sid": self.session_id, "holder": self.owner, "held_gen": self.generation}

    @property
    def released(self) -> bool:
        """True once :meth:`release` (or :meth:`detach`) ran."""
        return self._released.is_set()

    @property
    def lost(self) -> bool:
        """True once this holder found its lease taken over (or its row gone)."""
        return self._lost is not None

    def lost_error(self) -> LeaseLostError:
        """The :class:`LeaseLostError` that found the loss (raise it again). Only when :attr:`lost`."""
        assert self._lost is not None
        return self._lost

    @property
    def expires_at(self) -> datetime:
        """When the lease lapses unless renewed (as of this holder's last acquire or renewal)."""
        return self._expires_at

    def _mark_lost(self, err: LeaseLostError) -> None:
        with self._mu:
            if self._lost is not None:
                return
            self._lost = err
        log.warning("%s", err)
        if self._on_lost is not None:
            try:
                self._on_lost(err)
            except Exception:
                log.exception("lease on session %r: the on_lost callback failed", self.session_id)

    def renew(self) -> None:
        """Push the expiry to now + ttl, if this holder still has the lease. A
        no-op once released (a renewal never brings a released lease back).

        Raises:
            LeaseLostError: another owner took it over, or its row is gone
                (the lease is marked lost).
            sqlalchemy.exc.SQLAlchemyError: the index failed; the lease is
                unchanged (retry).
        """
        if self._lost is not None:
            raise self._lost
        with self._io:
            if self._released.is_set():
                return
            now = self._clock()
            expires = now + timedelta(seconds=self.ttl_s)
            with self._factory() as s, s.begin():
                res = s.connection().execute(_RENEW, {**self._held, "now": now, "expires": expires})
                err = _lost_error(s, self) if res.rowcount != 1 else None
        if err is not None:
            self._mark_lost(err)
            raise err
        self._expires_at = expires

    def ensure(self) -> None:
        """Make sure this holder still has the lease before it starts work on the session.

        Cheap while renewal keeps up: it only checks :attr:`lost`. When the
        last renewal is overdue (this process was paused, or the index was
        failing), it renews now, so a holder that lost its lease learns it
        before writing. A renewal that fails on the index is logged and left
        to the fenced write, which cannot succeed without the lease.

        Raises:
            LeaseLostError: the lease is lost.
        """
        if self._lost is not None:
            raise self._lost
        if self._released.is_set():
            return
        if (self._expires_at - self._clock()).total_seconds() > self.ttl_s / 2:
            return
        try:
            self.renew()
        except LeaseLostError:
            raise
        except Exception as e:
            log.warning("lease on session %r: could not renew it before a turn (%s); "
                        "the turn's writes are still fenced", self.session_id, e)

    def release(self) -> None:
        """Mark the lease row released if this holder still has it (generation
        kept, so the next holder's is larger). Idempotent; a lost lease is
        only detached."""
        if self._released.is_set():
            return
        self.detach()
        if self._lost is not None:
            return
        with self._io, self._factory() as s, s.begin():
            s.connection().execute(_RELEASE, {**self._held, "released_at": RELEASED_AT})

    def detach(self) -> None:
        """Stop renewing and mark the lease released without touching its row.

        For when the row is already gone (the session was deleted along with
        its lease in one transaction), or superseded. Idempotent.
        """
        self._released.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _renew_loop(self) -> None:
        interval = self.ttl_s / 3
        delay, failures = interval, 0
        while not self._released.wait(delay):
            try:
                self.renew()
            except LeaseLostError:
                return  # marked lost and logged; nothing left to renew
            except Exception as e:  # the index failed: retry sooner, backing off up to the interval
                if self._released.is_set():
                    return
                failures += 1
                delay = min(RENEW_RETRY_S * 2 ** (failures - 1), interval) * random.uniform(0.8, 1.0)
                level = logging.WARNING if failures == 1 or failures % 20 == 0 else logging.DEBUG
                log.log(level, "lease on session %r: renewal failed (%d in a row), retrying in %.2f s: %s",
                        self.session_id, failures, delay, e)
                continue
            if failures:
                log.info("lease on session %r: renewed again after %d failures", self.session_id, failures)
            delay, failures = interval, 0
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
    on_lost: Callable[[LeaseLostError], None] | None = None,
    within: Callable[[Session], None] | None = None,
) -> Lease:
    """Acquire the lease on ``session_id`` for ``owner``, waiting up to ``timeout_s``.

    Each attempt is one transaction (:func:`try_acquire`); a held lease is
    looked at again every ``poll_s`` until it is released, expires, or its
    holder is provably gone.

    Args:
        clock: judges whether a held lease has expired (default :func:`~.schema.utcnow`).
        on_wait: called once, with the blocking owner's id, when the first
            attempt finds the lease held and the call starts waiting.
        on_renew, on_lost: passed to the :class:`Lease`.
        within: called with the transaction that took the lease, before it
            commits, for work that must see the index as the lease found it
            (and costs no transaction of its own). If it raises, nothing of
            the attempt is committed, the lease is not taken, and the error
            propagates (an :class:`~sqlalchemy.exc.IntegrityError`, a racing
            insert, makes the attempt start again, ``within`` included).

    Raises:
        SessionLockedError: still held by another live owner after ``timeout_s``.
    """
    deadline = time.monotonic() + max(timeout_s, 0.0)
    waiting = False
    races = 0
    while True:
        now = clock()
        gen: int | None = None
        blocker: Holder | None = None
        try:
            with session_factory() as s, s.begin():
                gen, blocker = try_acquire(s, session_id, owner, ttl_s, now)
                if gen is not None and within is not None:
                    within(s)
        except IntegrityError:  # someone inserted first; look again
            pass
        if gen is not None:
            return Lease(session_id, owner, ttl_s, session_factory, auto_renew, generation=gen, clock=clock,
                         expires_at=now + timedelta(seconds=ttl_s), on_renew=on_renew, on_lost=on_lost)
        if blocker is None and races < 3:  # another taker changed the row meanwhile: look again at once
            races += 1
            continue
        if time.monotonic() >= deadline:
            h = blocker or Holder("(a racing owner)", 0, now)
            raise SessionLockedError(session_id, h.owner, (h.expires_at - now).total_seconds())
        if blocker is not None and not waiting:
            waiting = True
            if on_wait is not None:
                on_wait(blocker.owner)
        time.sleep(poll_s)
