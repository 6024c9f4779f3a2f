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

from typing import TYPE_CHECKING, Any

#: Public name -> (submodule, name in it). Names load on first use, so
#: ``import chatkv.storage.quickread`` (what ``sessions ls`` reads with) does
#: not pay for SQLAlchemy's import, which every other part of the index needs.
_LAZY: dict[str, tuple[str, str]] = {
    "BundleError": ("errors", "BundleError"),
    "BundleLimits": ("bundle", "BundleLimits"),
    "CHUNK_FORMAT_VERSION": ("chunkfile", "FORMAT_VERSION"),
    "ChunkFile": ("chunkfile", "ChunkFile"),
    "ChunkHash": ("hashing", "ChunkHash"),
    "ChunkInfo": ("records", "ChunkInfo"),
    "ChunkSource": ("store", "ChunkSource"),
    "ChunkMeta": ("chunkfile", "ChunkMeta"),
    "ChunkUsage": ("records", "ChunkUsage"),
    "Converted": ("chunkfile", "Converted"),
    "CorruptChunkError": ("errors", "CorruptChunkError"),
    "DebrisReport": ("records", "DebrisReport"),
    "DiskGcReport": ("gc", "DiskGcReport"),
    "DiskPolicy": ("gc", "DiskPolicy"),
    "DiskUsage": ("records", "DiskUsage"),
    "FingerprintMismatchError": ("errors", "FingerprintMismatchError"),
    "GcReport": ("records", "GcReport"),
    "InvalidSessionIdError": ("errors", "InvalidSessionIdError"),
    "Lease": ("leases", "Lease"),
    "LeasedSession": ("store", "LeasedSession"),
    "LeaseLostError": ("errors", "LeaseLostError"),
    "LoadedChunk": ("records", "LoadedChunk"),
    "MAX_SESSION_ID_LEN": ("ids", "MAX_SESSION_ID_LEN"),
    "MessageRecord": ("records", "MessageRecord"),
    "MissingChunkError": ("errors", "MissingChunkError"),
    "NewChunk": ("records", "NewChunk"),
    "NewMessage": ("records", "NewMessage"),
    "RemoveResult": ("records", "RemoveResult"),
    "SCHEMA_VERSION": ("migrations", "LATEST_VERSION"),
    "SaveResult": ("records", "SaveResult"),
    "SchemaVersionError": ("errors", "SchemaVersionError"),
    "SessionBytes": ("records", "SessionBytes"),
    "SessionExistsError": ("errors", "SessionExistsError"),
    "SessionInfo": ("records", "SessionInfo"),
    "SessionKV": ("records", "SessionKV"),
    "SessionLockedError": ("errors", "SessionLockedError"),
    "SessionNotFoundError": ("errors", "SessionNotFoundError"),
    "PlaneSpans": ("nativeread", "PlaneSpans"),
    "Planes": ("nativeread", "Planes"),
    "Spans": ("nativeread", "Spans"),
    "StorageError": ("errors", "StorageError"),
    "StorageWriteError": ("errors", "StorageWriteError"),
    "Store": ("store", "Store"),
    "StoredKV": ("store", "StoredKV"),
    "chunk_hash": ("hashing", "chunk_hash"),
    "collect_garbage": ("gc", "collect_garbage"),
    "default_db_url": ("paths", "default_db_url"),
    "default_home": ("paths", "default_home"),
    "enforce_disk_policy": ("gc", "enforce_disk_policy"),
    "export_session": ("bundle", "export_session"),
    "extract_archive": ("archive", "extract_archive"),
    "import_session": ("bundle", "import_session"),
    "pack_token_ids": ("hashing", "pack_token_ids"),
    "unpack_token_ids": ("hashing", "unpack_token_ids"),
    "validate_session_id": ("ids", "validate_session_id"),
}

__all__ = [
    "BundleError", "BundleLimits", "CHUNK_FORMAT_VERSION", "ChunkFile", "ChunkHash", "ChunkInfo", "ChunkMeta", "ChunkSource", "ChunkUsage",
    "Converted", "CorruptChunkError", "DebrisReport", "DiskGcReport", "DiskPolicy", "DiskUsage", "FingerprintMismatchError", "GcReport",
    "InvalidSessionIdError", "Lease", "LeaseLostError", "LeasedSession", "LoadedChunk", "MAX_SESSION_ID_LEN", "MessageRecord", "MissingChunkError",
    "NewChunk", "NewMessage", "PlaneSpans", "Planes", "RemoveResult", "SCHEMA_VERSION", "SaveResult", "SchemaVersionError",
    "SessionBytes", "SessionExistsError", "SessionInfo", "SessionKV", "SessionLockedError",
    "SessionNotFoundError", "Spans", "StorageError", "StorageWriteError", "Store", "StoredKV", "chunk_hash", "collect_garbage",
    "default_db_url", "default_home", "enforce_disk_policy", "export_session", "extract_archive", "import_session",
    "pack_token_ids", "unpack_token_ids", "validate_session_id",
]


if TYPE_CHECKING:
    from .archive import extract_archive
    from .bundle import BundleLimits, export_session, import_session
    from .chunkfile import FORMAT_VERSION as CHUNK_FORMAT_VERSION
    from .chunkfile import ChunkFile, ChunkMeta, Converted
    from .errors import (
        BundleError,
        CorruptChunkError,
        FingerprintMismatchError,
        InvalidSessionIdError,
        LeaseLostError,
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
    from .nativeread import PlaneSpans, Planes, Spans
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
    from .store import ChunkSource, LeasedSession, Store, StoredKV


def __getattr__(name: str) -> Any:
    """Import a public name's submodule on first access (PEP 562)."""
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    # __import__ (the import statement's machinery, not importlib.import_module)
    # so that `python -X importtime` logs the submodule like any other import.
    value = getattr(__import__(f"{__name__}.{module}", fromlist=[attr]), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
