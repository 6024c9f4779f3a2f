"""Proof that a Store is gone: one ``flock``ed lock file per open Store.

Every writable :class:`~.store.Store` takes a random owner token and holds an
exclusive ``flock`` on ``<home>/owners/<token>.lock`` for its life. The kernel
drops the lock when the process exits, however it exits (``kill -9``
included), so anyone who can take the lock knows that Store is gone: not
paused, not in another PID namespace, gone. Files it may have left (temp files
named with its token, chunk files it recorded as pending) can then be removed
at once instead of after gc's grace period.

A lock file is created under a temporary name, locked, then renamed into
place, so no other process ever sees an unlocked lock file of a live Store.
Where ``flock`` is unavailable (no ``fcntl``, or a file system without it),
no Store is ever judged gone: leftovers wait for gc's grace period as before.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
from pathlib import Path

from .paths import LOCK_SUFFIX, OWNERS_DIR, TMP_PREFIX, TOKEN_RE

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux/macOS
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


def new_token() -> str:
    """A fresh owner token (16 hex digits)."""
    return secrets.token_hex(8)


class OwnerLock:
    """This Store's lock file, held until :meth:`release`.

    Construction never raises: if the lock cannot be taken (read-only home, no
    ``flock``), :attr:`held` is False and nothing changes for anyone else
    (nobody can prove this Store gone, so its leftovers wait for gc).
    """

    def __init__(self, home: Path, token: str, owner: str) -> None:
        self.token = token
        self.path = home / OWNERS_DIR / f"{token}{LOCK_SUFFIX}"
        self._fd = -1
        if fcntl is None:
            return
        tmp = self.path.with_name(f"{TMP_PREFIX}{token}{LOCK_SUFFIX}")
        fd = -1
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{owner}\n".encode())
            os.replace(tmp, self.path)
        except OSError as e:
            log.debug("no owner lock in %s (%s); this Store's leftovers will wait for gc", self.path.parent, e)
            if fd >= 0:
                os.close(fd)
                _unlink(tmp)
            return
        self._fd = fd

    @property
    def held(self) -> bool:
        """True while this Store holds its lock file."""
        return self._fd >= 0

    def release(self) -> None:
        """Remove the lock file and drop the lock. Idempotent."""
        if self._fd < 0:
            return
        _unlink(self.path)
        os.close(self._fd)
        self._fd = -1


def gone_owners(home: Path, exclude: str | None = None) -> dict[str, int]:
    """Tokens of Stores whose lock file exists and can be locked: provably gone.

    Returns ``{token: fd}``; each fd holds that dead Store's lock, so no two
    sweeps clean the same owner at once. Pass the dict to :func:`forget` when done.
    """
    out: dict[str, int] = {}
    if fcntl is None:
        return out
    d = home / OWNERS_DIR
    try:
        entries = list(os.scandir(d))
    except OSError:
        return out
    for e in entries:
        name = e.name
        if name.startswith(TMP_PREFIX) and name.endswith(LOCK_SUFFIX):
            _reap_tmp_lock(Path(e.path))
            continue
        token = name[: -len(LOCK_SUFFIX)] if name.endswith(LOCK_SUFFIX) else ""
        if not TOKEN_RE.fullmatch(token) or token == exclude:
            continue
        try:
            fd = os.open(e.path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                log.debug("cannot test owner lock %s: %s", e.path, err)
            continue
        out[token] = fd
    return out


def forget(home: Path, gone: dict[str, int]) -> None:
    """Remove the lock files of swept owners (their leftovers are gone) and drop their locks."""
    for token, fd in gone.items():
        _unlink(home / OWNERS_DIR / f"{token}{LOCK_SUFFIX}")
        os.close(fd)


def _reap_tmp_lock(path: Path) -> None:
    """A lock file whose Store died between creating and renaming it."""
    assert fcntl is not None
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _unlink(path)
    except OSError:
        pass  # still being created by a live Store
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not remove %s: %s", path, e)
