"""Where chatkv keeps its files: the home directory and the layout under it.

Layout::

    <home>/index.db                  default SQLite index (CHATKV_DB_URL overrides)
    <home>/kv/<h[:2]>/<h>.safetensors  content-addressed chunk files
    <home>/quarantine/               chunk files that failed verification
"""

from __future__ import annotations

import os
from pathlib import Path

from .hashing import ChunkHash

HOME_ENV = "CHATKV_HOME"
DB_URL_ENV = "CHATKV_DB_URL"
KV_DIR = "kv"
QUARANTINE_DIR = "quarantine"
CHUNK_SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"


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


def chunk_relpath(h: ChunkHash) -> str:
    """Path of a chunk file relative to the home, with ``/`` separators."""
    return f"{KV_DIR}/{h[:2]}/{h}{CHUNK_SUFFIX}"
