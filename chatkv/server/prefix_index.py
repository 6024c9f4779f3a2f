"""The message-prefix index: which stored session a whole-history request continues.

OpenAI clients send the whole conversation every turn and no session id. To
continue the right chatkv session (and so reuse its KV, from any tier, even
after a restart) the server keeps, for every session it knows, a chained hash
of each prefix of its messages: ``h[0]`` is a constant, ``h[i]`` hashes
``h[i-1]`` and the ``i``-th message's role and content. A request's own
prefix hashes then find, in one indexed query, every session that shares a
prefix with it, and how long.

The index is a cache, never the truth: the server checks a candidate's
messages in the store before using it, and re-records (or forgets) entries
that turn out stale, e.g. after a session was changed by ``chatkv repl``.

It lives in a small SQLite file of its own, ``$CHATKV_HOME/server/prefixes.db``
(one per host: with ``CHATKV_DB_URL`` on a shared database, each server host
keeps its own index and syncs it from the store at start-up).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

FORMAT = "chatkv.prefix-index/1"
_SEED = hashlib.sha256(FORMAT.encode()).digest()

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    length INTEGER NOT NULL,
    used REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS prefixes (
    session_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    hash BLOB NOT NULL,
    PRIMARY KEY (session_id, n)
);
CREATE INDEX IF NOT EXISTS prefixes_by_hash ON prefixes (tenant, hash);
"""


def prefix_hashes(messages: Sequence[dict[str, str]]) -> list[bytes]:
    """``[h1, ..., hn]``: the chained hash of each prefix ``messages[:i]``."""
    out: list[bytes] = []
    h = _SEED
    for m in messages:
        h = hashlib.sha256(h + json.dumps([m["role"], m["content"]], ensure_ascii=False).encode()).digest()
        out.append(h)
    return out


@dataclass(frozen=True)
class Candidate:
    """A stored session sharing the request's first ``n`` messages.

    Attributes:
        session_id: its stored id.
        n: how many leading messages it shares with the request.
        full: its whole history is those ``n`` messages (the request continues it).
        used: when the server last recorded it (seconds since the epoch).
    """

    session_id: str
    n: int
    full: bool
    used: float


class PrefixIndex:
    """The prefix hashes of every known session's history, in a SQLite file. Thread-safe."""

    def __init__(self, path: str | Path) -> None:
        """Open (creating if needed) the index at ``path``."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=10.0, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='format'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('format', ?)", (FORMAT,))
            elif row[0] != FORMAT:  # another hashing: start over (it is only a cache)
                self._db.executescript("DELETE FROM prefixes; DELETE FROM sessions;")
                self._db.execute("UPDATE meta SET value=? WHERE key='format'", (FORMAT,))

    def close(self) -> None:
        """Close the file. Idempotent."""
        with self._lock:
            self._db.close()

    def record(self, session_id: str, tenant: str, messages: Sequence[dict[str, str]]) -> None:
        """Make ``messages`` the indexed history of ``session_id`` (of ``tenant``), as of now."""
        hashes = prefix_hashes(messages)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM prefixes WHERE session_id=?", (session_id,))
                self._db.executemany("INSERT INTO prefixes VALUES (?, ?, ?, ?)",
                                     [(session_id, i + 1, tenant, h) for i, h in enumerate(hashes)])
                self._db.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?)",
                                 (session_id, tenant, len(hashes), time.time()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def forget(self, session_id: str) -> None:
        """Drop ``session_id`` from the index."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM prefixes WHERE session_id=?", (session_id,))
            self._db.execute("DELETE FROM sessions WHERE session_id=?", (session_id,))
            self._db.execute("COMMIT")

    def candidates(self, tenant: str, messages: Sequence[dict[str, str]], limit: int = 8) -> list[Candidate]:
        """Sessions of ``tenant`` sharing a prefix of ``messages``: first those whose
        whole history is a prefix of ``messages`` (longest first), then those
        sharing only part of their history (longest shared prefix first); the
        most recently used first among equals."""
        hashes = prefix_hashes(messages)
        if not hashes:
            return []
        position = {h: i + 1 for i, h in enumerate(hashes)}
        found: dict[str, Candidate] = {}
        with self._lock:
            for start in range(0, len(hashes), 500):  # SQLite's parameter limit
                part = hashes[start:start + 500]
                rows = self._db.execute(
                    "SELECT p.session_id, p.n, p.hash, s.length, s.used FROM prefixes p "
                    "JOIN sessions s ON s.session_id = p.session_id "
                    f"WHERE p.tenant=? AND p.hash IN ({','.join('?' * len(part))})", (tenant, *part)).fetchall()
                for sid, n, h, length, used in rows:
                    if position.get(bytes(h)) != n:
                        continue
                    best = found.get(sid)
                    if best is None or n > best.n:
                        found[sid] = Candidate(sid, n, n == length, used)
        ranked = sorted(found.values(), key=lambda c: (not c.full, -c.n, -c.used))
        return ranked[:limit]

    def recorded(self) -> dict[str, float]:
        """``{session_id: when its history was last recorded}`` (seconds since the epoch)."""
        with self._lock:
            return dict(self._db.execute("SELECT session_id, used FROM sessions").fetchall())

    def known(self) -> set[str]:
        """Every indexed session id."""
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT session_id FROM sessions")}

    def forget_many(self, session_ids: Iterable[str]) -> None:
        """Drop several sessions."""
        for sid in session_ids:
            self.forget(sid)
