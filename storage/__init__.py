"""chatkv's durable layer: the SQLAlchemy index and content-addressed safetensors chunk files.

Knows files, tensors and the index; never the model. Installed as
``chatkv.storage``; imports nothing from ``chatkv``.

Importing it, and everything that touches only the index (listing,
inspecting, deleting sessions, leases, gc and the disk policy, exporting a
session without KV), loads neither torch nor transformers: torch is imported
on first use by the code that reads or writes tensors (chunk files and
bundles with KV).

Layers, each using only the public methods of the one below:
:class:`Store` (index and chunk files) <- :mod:`.bundle`
(:func:`export_session`, :func:`import_session`, :func:`extract_archive`) and :mod:`.gc`
(:func:`collect_garbage`, :func:`enforce_disk_policy`).
"""

from __future__ import annotations

from .archive import extract_archive
from .bundle import BundleLimits, export_session, import_session
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
from .gc import DiskGcReport, DiskPolicy, collect_garbage, enforce_disk_policy
from .hashing import ChunkHash, chunk_hash, pack_token_ids, unpack_token_ids
from .ids import MAX_SESSION_ID_LEN, validate_session_id
from .leases import Lease
from .migrations import LATEST_VERSION as SCHEMA_VERSION
from .paths import default_db_url, default_home
from .records import (
    ChunkInfo,
    ChunkUsage,
    DebrisReport,
    DiskUsage,
    GcReport,
    LoadedChunk,
    MessageRecord,
    NewChunk,
    NewMessage,
    RemoveResult,
    SaveResult,
    SessionBytes,
    SessionInfo,
    SessionKV,
)
from .store import Store

__all__ = [
    "BundleError", "BundleLimits", "CHUNK_FORMAT_VERSION", "ChunkFile", "ChunkHash", "ChunkInfo", "ChunkMeta", "ChunkUsage",
    "CorruptChunkError", "DebrisReport", "DiskGcReport", "DiskPolicy", "DiskUsage", "FingerprintMismatchError", "GcReport",
    "InvalidSessionIdError", "Lease", "LoadedChunk", "MAX_SESSION_ID_LEN", "MessageRecord", "MissingChunkError",
    "NewChunk", "NewMessage", "RemoveResult", "SCHEMA_VERSION", "SaveResult", "SchemaVersionError",
    "SessionBytes", "SessionExistsError", "SessionInfo", "SessionKV", "SessionLockedError",
    "SessionNotFoundError", "StorageError", "StorageWriteError", "Store", "chunk_hash", "collect_garbage",
    "default_db_url", "default_home", "enforce_disk_policy", "export_session", "extract_archive", "import_session",
    "pack_token_ids", "unpack_token_ids", "validate_session_id",
]
