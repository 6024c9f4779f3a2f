"""The exceptions ``chatkv.storage`` raises; every one derives from :class:`StorageError`."""

from __future__ import annotations


class StorageError(Exception):
    """Base class of every error raised by ``chatkv.storage``."""


class InvalidSessionIdError(StorageError, ValueError):
    """A session id is empty, too long, or uses characters outside ``[A-Za-z0-9._-]``."""


class SessionNotFoundError(StorageError, KeyError):
    """The session id has no row in the index."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "session not found"


class SessionExistsError(StorageError):
    """An import would overwrite an existing session and ``overwrite`` was not given."""


class SessionLockedError(StorageError):
    """Another live owner holds the session's lease."""

    def __init__(self, session_id: str, owner: str, expires_in_s: float) -> None:
        self.session_id = session_id
        self.owner = owner
        self.expires_in_s = expires_in_s
        super().__init__(
            f"session {session_id!r} is in use by {owner} "
            f"(its lease expires in {max(expires_in_s, 0.0):.1f}s unless renewed); "
            "close the other process or wait for it"
        )


class LeaseLostError(SessionLockedError):
    """This holder had the session's lease and lost it: it lapsed (the process
    was paused, or cut off from the index, past its expiry) and another owner
    took it over, or the session was deleted.

    Raised by every write the old holder attempts after the takeover, and by
    its next turn; nothing of the refused write is committed. Its in-memory
    view of the session may be stale, so it must stop writing the session:
    close it and open it again to continue from what the store holds.

    Attributes:
        session_id: the session.
        lost_by: this holder's owner id.
        generation: the fencing token it held.
        owner: the owner that holds the lease now (``"(nobody)"`` if it was
            released or deleted since).
        holder_generation: the lease row's generation now, if it exists.
    """

    def __init__(self, session_id: str, lost_by: str, generation: int, holder: str | None = None,
                 holder_generation: int | None = None) -> None:
        self.session_id = session_id
        self.lost_by = lost_by
        self.generation = generation
        self.owner = holder or "(nobody)"
        self.holder_generation = holder_generation
        self.expires_in_s = 0.0
        by = f"taken over by {holder} (generation {holder_generation})" if holder else "taken over or deleted"
        StorageError.__init__(
            self,
            f"this process lost the lease on session {session_id!r} (generation {generation}): it was {by}; "
            "nothing more is written to it from here: close it and open it again",
        )


class StorageWriteError(StorageError):
    """A file or index write failed (disk full, read-only home, I/O error).

    Nothing half-written is left behind: no temporary file and no index row.
    The in-memory conversation can go on; only persistence failed.
    """


class SchemaVersionError(StorageError):
    """The index database was written by a newer chatkv, or is not a chatkv index."""


class CorruptChunkError(StorageError):
    """A chunk file failed verification (size, checksum, format, fingerprint, hash).

    By the time this is raised the file is in ``<home>/quarantine/`` and its rows
    are gone; sessions that used it keep only the chunks before it, so the caller
    re-prefills the rest from history.
    """

    def __init__(self, chunk_hash: str, reason: str, sessions: tuple[str, ...] = ()) -> None:
        self.chunk_hash = chunk_hash
        self.reason = reason
        self.sessions = sessions
        super().__init__(f"KV chunk {chunk_hash[:16]}… is unusable: {reason}")


class MissingChunkError(CorruptChunkError):
    """An indexed chunk file does not exist on disk."""


class FingerprintMismatchError(StorageError):
    """The stored KV was made by a different model fingerprint than the caller's."""

    def __init__(self, session_id: str, stored: str | None, expected: str) -> None:
        self.session_id = session_id
        self.stored = stored
        self.expected = expected
        super().__init__(
            f"session {session_id!r} has KV for fingerprint {stored!r}, not {expected!r}; "
            "it must be re-prefilled from history"
        )


class BundleError(StorageError, ValueError):
    """An exported session bundle is malformed, corrupt or of an unknown version."""
