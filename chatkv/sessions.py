"""Inspecting and managing stored sessions from Python.

Thin functions over the store at ``$CHATKV_HOME`` (or the one passed in), for
apps and for ``chatkv sessions``: list, inspect, delete, export and import.
"""

from __future__ import annotations

import os
from pathlib import Path

from chatkv.persistence import default_store
from chatkv.storage import (
    MessageRecord,
    RemoveResult,
    SessionBytes,
    SessionInfo,
    Store,
    export_session,
    import_session,
)


def _store(store: Store | None) -> Store:
    return store if store is not None else default_store()


def list_sessions(store: Store | None = None) -> list[SessionInfo]:
    """Every stored session, most recently used first."""
    return _store(store).list_sessions()


def info(session_id: str, store: Store | None = None) -> SessionInfo:
    """Facts about one session (turns, cached tokens, bytes, tier, times).

    Raises:
        SessionNotFoundError: no such session.
    """
    return _store(store).get_session(session_id)


def history(session_id: str, store: Store | None = None) -> list[MessageRecord]:
    """The session's messages, in order (the source of truth; KV is a cache)."""
    return _store(store).messages(session_id)


def disk_bytes(session_id: str, store: Store | None = None) -> SessionBytes:
    """Bytes of the session's KV chunk files (``unique`` excludes shared chunks)."""
    return _store(store).session_bytes(session_id)


def delete(session_id: str, store: Store | None = None) -> RemoveResult:
    """Delete a session's history and KV; chunk files no other session uses are removed.

    Raises:
        SessionNotFoundError, SessionLockedError (another process is using it).
    """
    return _store(store).delete_session(session_id)


def export(session_id: str, dest: str | os.PathLike[str], store: Store | None = None) -> Path:
    """Write the session as a bundle (history JSON + KV safetensors) at ``dest``."""
    return export_session(_store(store), session_id, dest)


def import_(src: str | os.PathLike[str], session_id: str | None = None, *, overwrite: bool = False,
            with_kv: bool = True, store: Store | None = None) -> SessionInfo:
    """Import a bundle written by :func:`export`, verifying every chunk. The KV is
    imported unverified (the engine probes it against the model before using
    it); ``with_kv=False`` imports the history only (the next turn re-prefills).

    Raises:
        BundleError: the bundle is malformed, corrupt or unsafe (nothing is written).
        SessionExistsError: the id is taken and ``overwrite`` is False.
    """
    return import_session(_store(store), src, session_id=session_id, overwrite=overwrite, with_kv=with_kv)
