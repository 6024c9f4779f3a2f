"""Session ids: user input, validated before it reaches the index.

A session id is only ever a key in the index; it never becomes a path
component (files are named by content hashes).
"""

from __future__ import annotations

import re

from .errors import InvalidSessionIdError

MAX_SESSION_ID_LEN = 128
_ALLOWED = re.compile(r"[A-Za-z0-9._-]+")


def validate_session_id(session_id: object) -> str:
    """Return ``session_id`` unchanged if it is a valid session id.

    Valid: a ``str`` of 1..128 characters from ``[A-Za-z0-9._-]`` that does not
    start with ``.`` (which also rules out ``.`` and ``..``).

    Raises:
        InvalidSessionIdError: with a message naming the rule that failed.
    """
    if not isinstance(session_id, str):
        raise InvalidSessionIdError(f"session id must be a str, got {type(session_id).__name__}")
    if not session_id:
        raise InvalidSessionIdError("session id must not be empty")
    if len(session_id) > MAX_SESSION_ID_LEN:
        raise InvalidSessionIdError(
            f"session id is {len(session_id)} characters; at most {MAX_SESSION_ID_LEN} are allowed"
        )
    if not _ALLOWED.fullmatch(session_id):
        bad = sorted({c for c in session_id if not _ALLOWED.fullmatch(c)})
        raise InvalidSessionIdError(
            f"session id {session_id!r} has characters outside [A-Za-z0-9._-]: {''.join(bad)!r}"
        )
    if session_id.startswith("."):
        raise InvalidSessionIdError(f"session id {session_id!r} must not start with '.'")
    return session_id
