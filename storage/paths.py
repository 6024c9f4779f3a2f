"""Where chatkv keeps its files: the home directory and the layout under it.

Layout::

    <home>/index.db                  default SQLite index (CHATKV_DB_URL overrides)
    <home>/kv/<h[:2]>/<h>.safetensors  content-addressed chunk files (CHATKV_KV_DIR moves
                                     kv/ elsewhere: a directory several servers share)
    <home>/quarantine/               chunk files that failed verification
    <home>/owners/<token>.lock       one per open Store, flock()ed while it lives

Temporary files are named ``.tmp-<token>.<final name>.<random>`` where
``<token>`` is the writing Store's :func:`owner token <tmp_token>`, so once
that Store is provably gone (its lock file can be locked) they are removed at
once instead of after gc's grace period.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from .hashing import ChunkHash

HOME_ENV = "CHATKV_HOME"
DB_URL_ENV = "CHATKV_DB_URL"
KV_DIR_ENV = "CHATKV_KV_DIR"
KV_DIR = "kv"
QUARANTINE_DIR = "quarantine"
CHUNK_SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
OWNERS_DIR = "owners"
LOCK_SUFFIX = ".lock"
#: A Store's owner token: 16 lowercase hex digits (see :func:`tmp_name`).
TOKEN_RE = re.compile(r"[0-9a-f]{16}")


def default_home() -> Path:
    """``$CHATKV_HOME`` if set, else the platform's user data dir for ``chatkv``."""
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("chatkv", appauthor=False))


def default_db_url(home: Path) -> str:
    """``$CHATKV_DB_URL`` if set, else ``sqlite:///<home>/index.db``."""
    return os.environ.get(DB_URL_ENV) or f"sqlite:///{home / 'index.db'}"


def default_kv_dir(home: Path) -> Path:
    """``$CHATKV_KV_DIR`` if set, else ``<home>/kv``: where the chunk files live.

    Several servers with their own homes (model cache, REPL history, owner
    locks) share chunks by pointing this at one directory they all mount,
    next to one shared index (``CHATKV_DB_URL``).
    """
    env = os.environ.get(KV_DIR_ENV)
    return Path(env).expanduser() if env else home / KV_DIR


def chunk_relpath(h: ChunkHash) -> str:
    """A chunk file's name as the index records it: ``kv/<h[:2]>/<h>.safetensors``.

    The leading ``kv/`` stands for the chunk directory (:func:`default_kv_dir`),
    wherever it is: :func:`chunk_path` resolves it.
    """
    return f"{KV_DIR}/{h[:2]}/{h}{CHUNK_SUFFIX}"


def chunk_path(kv_dir: Path, relpath: str) -> Path:
    """The file a recorded ``relpath`` (``kv/<h[:2]>/<h>.safetensors``) names
    under ``kv_dir``. Raises ValueError for any other ``relpath``."""
    return Path(chunk_file(str(kv_dir), relpath))


def chunk_file(kv_dir: str, relpath: str) -> str:
    """:func:`chunk_path` as a string (a restore opens a chunk a few hundred
    microseconds apart: a Path costs several of them)."""
    head, sep, rest = relpath.partition("/")
    if head != KV_DIR or not sep:
        raise ValueError(f"not a chunk path: {relpath!r}")
    return os.path.join(kv_dir, rest)


def tmp_name(final_name: str, token: str | None = None) -> str:
    """A temporary file name for writing ``final_name``: ``.tmp-[<token>.]<final_name>.<random>``.

    Files carrying a ``token`` can be attributed to the Store that wrote them
    (see :mod:`.owners`); without one, only gc's grace period removes them.
    """
    tag = f"{token}." if token else ""
    return f"{TMP_PREFIX}{tag}{final_name}.{os.getpid()}.{secrets.token_hex(4)}"


def tmp_token(name: str) -> str | None:
    """The owner token in a temporary file's name, or None (not a temp file, or written without one)."""
    if not name.startswith(TMP_PREFIX):
        return None
    head = name[len(TMP_PREFIX):].partition(".")[0]
    return head if TOKEN_RE.fullmatch(head) else None


def file_size(p: Path) -> int:
    """Bytes of the file at ``p``; 0 if it is gone (a concurrent gc or save)."""
    try:
        return p.stat().st_size
    except OSError:
        return 0
