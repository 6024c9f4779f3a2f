"""chatkv's durable layer: the SQLAlchemy index and content-addressed safetensors chunk files.

Knows files, tensors and the index; never the model. Installed as
``chatkv.storage``; imports nothing from ``chatkv``.
"""

from __future__ import annotations

from .chunkfile import FORMAT_VERSION as CHUNK_FORMAT_VERSION
from .chunkfile import ChunkFile, ChunkMeta
from .errors import (
    BundleError,
    CorruptChunkError,
    FingerprintMismatchError,
    InvalidSessionIdError,
    MissingChunkError,
    SchemaVersionError,
    SessionExistsError,
    SessionLockedError,
    SessionNotFoundError,
    StorageError,
    StorageWriteError,
)
from .hashing import ChunkHash, chunk_hash, pack_token_ids, unpack_token_ids
from .ids import MAX_SESSION_ID_LEN, validate_session_id
from .leases import Lease
from .migrations import LATEST_VERSION as SCHEMA_VERSION
from .paths import default_db_url, default_home
from .records import (
    ChunkInfo,
    DiskUsage,
    GcReport,
    LoadedChunk,
    MessageRecord,
    NewChunk,
    RemoveResult,
    SaveResult,
    SessionBytes,
    SessionInfo,
    SessionKV,
)
from .store import Store

__all__ = [
    "BundleError", "CHUNK_FORMAT_VERSION", "ChunkFile", "ChunkHash", "ChunkInfo", "ChunkMeta",
    "CorruptChunkError", "DiskUsage", "FingerprintMismatchError", "GcReport", "InvalidSessionIdError",
    "Lease", "LoadedChunk", "MAX_SESSION_ID_LEN", "MessageRecord", "MissingChunkError", "NewChunk",
    "RemoveResult", "SCHEMA_VERSION", "SaveResult", "SchemaVersionError", "SessionBytes",
    "SessionExistsError", "SessionInfo", "SessionKV", "SessionLockedError", "SessionNotFoundError",
    "StorageError", "StorageWriteError", "Store", "chunk_hash", "default_db_url", "default_home",
    "pack_token_ids", "unpack_token_ids", "validate_session_id",
]
