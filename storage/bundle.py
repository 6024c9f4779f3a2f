"""Export and import one session as a portable bundle (a directory of two files).

``history.json``::

    {"format": "chatkv.session_bundle", "version": 1,
     "session": {"id", "fingerprint", "system_prompt", "created_at", "tier"},
     "messages": [{"index", "role", "content", "token_span", "created_at", "partial"}],
     "cached_token_ids": [...],
     "chunks": [{"hash", "parent", "n_tokens", "metadata": {<chunk file metadata>}}],
     "kv_file": "kv.safetensors" | null, "kv_sha256": "<hex>" | null}

``kv.safetensors``: every chunk's tensors as ``"<i>/<name>"`` (``i`` the
chunk's position, zero-padded) including ``"<i>/__token_ids__"``. Import
re-verifies each chunk's checksum and chained hash, and the file's sha256.

Both directions go through :class:`~.store.Store`'s public methods; torch
(and ``safetensors.torch``) is imported only when a bundle carries KV.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .chunkfile import (
    FORMAT_VERSION,
    TOKEN_IDS_KEY,
    atomic_write,
    ensure_dir,
    meta_from_file,
    payload_checksum,
    read_safetensors_metadata,
)
from .errors import BundleError, CorruptChunkError, SessionExistsError
from .hashing import ChunkHash, chunk_hash, is_chunk_hash, pack_token_ids
from .ids import validate_session_id
from .records import NewChunk, NewMessage, SessionInfo, SessionKV

if TYPE_CHECKING:
    from .store import Store

BUNDLE_FORMAT = "chatkv.session_bundle"
BUNDLE_VERSION = 1
HISTORY_FILE = "history.json"
KV_FILE = "kv.safetensors"


def export_session(store: "Store", session_id: str, dest: str | os.PathLike[str]) -> Path:
    """Write ``dest/history.json`` and, if the session has KV, ``dest/kv.safetensors``; return ``dest``.

    ``dest`` is created. Every chunk is read and verified first; if one turns
    out corrupt it is quarantined and the export retries with the shorter
    valid prefix, so the history is always exported.

    Raises:
        SessionNotFoundError, StorageWriteError (``dest`` not writable).
    """
    dest = Path(dest)
    for _ in range(8):
        try:
            kv = store.load_kv(session_id)
            break
        except CorruptChunkError:
            continue
    else:  # pragma: no cover
        raise BundleError(f"session {session_id!r} kept failing verification during export")
    info = store.get_session(session_id)
    ensure_dir(dest)
    chunks, kv_sha = _write_kv(store, kv, dest / KV_FILE) if kv.chunks else ([], None)
    doc = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "session": {"id": info.id, "fingerprint": kv.fingerprint if chunks else None,
                    "system_prompt": info.system_prompt, "created_at": info.created_at.isoformat(),
                    "tier": info.tier},
        "messages": [{"index": m.index, "role": m.role, "content": m.content,
                      "token_span": list(m.token_span) if m.token_span else None,
                      "created_at": m.created_at.isoformat(), "partial": m.partial}
                     for m in store.messages(session_id)],
        "cached_token_ids": kv.token_ids,
        "chunks": chunks,
        "kv_file": KV_FILE if chunks else None,
        "kv_sha256": kv_sha,
    }
    atomic_write(dest / HISTORY_FILE, json.dumps(doc, ensure_ascii=False, indent=1).encode())
    return dest


def _write_kv(store: "Store", kv: SessionKV, path: Path) -> tuple[list[dict[str, Any]], str]:
    """Write every chunk's tensors into one safetensors file; return the chunks' entries and its sha256."""
    import torch
    from safetensors.torch import save as st_save

    chunks: list[dict[str, Any]] = []
    tensors: dict[str, torch.Tensor] = {}
    for i, c in enumerate(kv.chunks):
        try:
            md = read_safetensors_metadata(store.path_of(c.info))
        except (OSError, ValueError) as e:  # it verified a moment ago: removed or rewritten since
            raise BundleError(f"chunk {c.info.hash[:16]} changed during the export: {e}") from e
        chunks.append({"hash": c.info.hash, "parent": c.info.parent, "n_tokens": c.info.n_tokens, "metadata": md})
        for name, t in c.tensors.items():
            tensors[f"{i:06d}/{name}"] = t
        tensors[f"{i:06d}/{TOKEN_IDS_KEY}"] = torch.tensor(c.token_ids, dtype=torch.int32)
    data = st_save(tensors, metadata={"format": "chatkv.session_kv_bundle", "version": str(BUNDLE_VERSION)})
    atomic_write(path, data)
    return chunks, hashlib.sha256(data).hexdigest()


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise BundleError(msg)


def _load_doc(src: Path) -> dict[str, Any]:
    path = src / HISTORY_FILE if src.is_dir() else src
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"no {HISTORY_FILE} in {src}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path} is not readable JSON: {e}") from e
    _need(isinstance(doc, dict) and doc.get("format") == BUNDLE_FORMAT, f"{path} is not a chatkv session bundle")
    _need(doc.get("version") == BUNDLE_VERSION,
          f"bundle version {doc.get('version')!r} is not supported (this chatkv reads {BUNDLE_VERSION})")
    for key, typ in (("session", dict), ("messages", list), ("chunks", list), ("cached_token_ids", list)):
        _need(isinstance(doc.get(key), typ), f"bundle field {key!r} is missing or not a {typ.__name__}")
    for m in doc["messages"]:
        _need(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str),
              "a message lacks a string role or content")
        span = m.get("token_span")
        _need(span is None or (isinstance(span, list) and len(span) == 2 and all(isinstance(t, int) for t in span)
                               and 0 <= span[0] <= span[1]),
              "a message's token_span is not null or [start, end] with 0 <= start <= end")
    return doc


def import_session(store: "Store", src: str | os.PathLike[str], *, session_id: str | None = None,
                   overwrite: bool = False) -> SessionInfo:
    """Import a bundle made by :func:`export_session`; return the new session's facts.

    The bundle is validated fully first (format, checksums, chained hashes,
    sha256); then its chunk files are written (deduplicated) and the session,
    its messages and KV links commit in one transaction
    (:meth:`Store.create_session`).

    Args:
        src: the bundle directory, or its ``history.json``.
        session_id: import under this id instead of the bundle's.
        overwrite: replace an existing session of that id (in the same transaction).

    Raises:
        BundleError: malformed, corrupt or unsupported input (nothing is written).
        SessionExistsError: the id exists and ``overwrite`` is false.
        InvalidSessionIdError, SessionLockedError, StorageWriteError.
    """
    src = Path(src)
    doc = _load_doc(src)
    sid = validate_session_id(session_id or doc["session"].get("id"))
    ids = doc["cached_token_ids"]
    _need(all(isinstance(t, int) for t in ids), "cached_token_ids must be integers")
    try:
        pack_token_ids(ids)
    except ValueError as e:
        raise BundleError(str(e)) from e
    new_chunks: list[NewChunk] = []
    fp: str | None = doc["session"].get("fingerprint")
    if doc["chunks"]:
        base = src if src.is_dir() else src.parent
        kv_path = base / str(doc.get("kv_file") or KV_FILE)
        try:
            raw = kv_path.read_bytes()
        except OSError as e:
            raise BundleError(f"cannot read the bundle's KV file {kv_path}: {e}") from e
        _need(hashlib.sha256(raw).hexdigest() == doc.get("kv_sha256"), f"{kv_path.name} does not match its sha256")
        from safetensors.torch import load as st_load

        try:
            all_t = st_load(raw)
        except Exception as e:  # safetensors raises its own error types for any malformed input
            raise BundleError(f"{kv_path.name} is not a readable safetensors file: {e}") from e
        parent: ChunkHash | None = None
        off = 0
        for i, c in enumerate(doc["chunks"]):
            _need(isinstance(c, dict) and isinstance(c.get("metadata"), dict), f"chunk {i} is malformed")
            md = {str(k): str(v) for k, v in c["metadata"].items()}
            _need(md.get("format_version") == FORMAT_VERSION, f"chunk {i} has unknown format version")
            pre = f"{i:06d}/"
            ts = {k[len(pre):]: v for k, v in all_t.items() if k.startswith(pre)}
            tok = ts.get(TOKEN_IDS_KEY)
            _need(tok is not None, f"chunk {i} has no token ids")
            assert tok is not None
            checksum, _ = payload_checksum(ts)
            _need(checksum == md.get("checksum"), f"chunk {i} fails its checksum")
            toks = tok.tolist()
            _need(toks == ids[off: off + len(toks)], f"chunk {i}'s tokens differ from cached_token_ids")
            h = c.get("hash")
            _need(is_chunk_hash(h) and md.get("chunk_hash") == h, f"chunk {i} has a bad hash")
            _need(chunk_hash(parent, toks, md.get("fingerprint", ""), md.get("kv_format", "")) == h,
                  f"chunk {i}'s hash does not chain over its tokens")
            _need(md.get("fingerprint") == fp, f"chunk {i}'s fingerprint differs from the session's")
            del ts[TOKEN_IDS_KEY]
            try:
                meta = meta_from_file(md)
            except (KeyError, ValueError) as e:
                raise BundleError(f"chunk {i} metadata is incomplete: {e}") from e
            new_chunks.append(NewChunk(len(toks), ts, meta))
            parent = ChunkHash(h)
            off += len(toks)
        _need(off == len(ids), "chunks do not cover cached_token_ids")
    elif ids:
        raise BundleError("cached_token_ids given but no chunks")

    if not overwrite and store.has_session(sid):
        raise SessionExistsError(f"session {sid!r} exists; pass overwrite=True or another session_id")
    s_doc = doc["session"]
    messages = [NewMessage(role=m["role"], content=m["content"],
                           token_span=(m["token_span"][0], m["token_span"][1]) if m.get("token_span") else None,
                           partial=bool(m.get("partial")), created_at=_parse_time(m.get("created_at")))
                for m in doc["messages"]]
    try:
        return store.create_session(
            sid, fingerprint=fp if new_chunks else None, system_prompt=s_doc.get("system_prompt"),
            created_at=_parse_time(s_doc.get("created_at")), messages=messages, token_ids=ids,
            chunks=new_chunks, replace=overwrite)
    except SessionExistsError:
        raise SessionExistsError(f"session {sid!r} exists; pass overwrite=True or another session_id") from None


def _parse_time(v: object) -> datetime | None:
    if not isinstance(v, str):
        return None
    try:
        return datetime.fromisoformat(v)
    except ValueError:
        return None
