"""Export and import one session as a portable bundle (a directory of two files).

``history.json``::

    {"format": "chatkv.session_bundle", "version": 1,
     "session": {"id", "fingerprint", "system_prompt", "created_at", "tier"},
     "messages": [{"index", "role", "content", "token_span", "created_at", "partial", "outside_window"}],
     "cached_token_ids": [...],
     "chunks": [{"hash", "parent", "n_tokens", "metadata": {<chunk file metadata>}}],
     "kv_file": "kv.safetensors" | null, "kv_sha256": "<hex>" | null}

``kv.safetensors``: every chunk's tensors as ``"<i>/<name>"`` (``i`` the
chunk's position, zero-padded) including ``"<i>/__token_ids__"``.

A bundle is untrusted input. Import reads only regular files inside the
bundle directory (never a symlink, FIFO or device), checks every size against
:class:`BundleLimits` before reading, accepts only ``system`` (first message
only), ``user`` and ``assistant`` messages with string content, and checks the
KV: an exactly laid-out safetensors file, float32/float16/bfloat16 tensors,
finite values, the same tensors in every chunk with shapes that follow each
chunk's token count, each chunk's checksum and chained hash, and the file's
sha256. None of that proves the KV was made by the model its fingerprint
names (anyone can write that string), so imported KV is stored as
*unverified* (:attr:`SessionInfo.kv_verified` False) until the engine checks
it against the model (:meth:`Store.mark_kv_verified`) or drops it;
``with_kv=False`` imports the history alone.

Both directions go through :class:`~.store.Store`'s public methods; torch
(and ``safetensors.torch``) is imported only when a bundle carries KV.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .chunkfile import (
    FORMAT,
    FORMAT_VERSION,
    TOKEN_IDS_KEY,
    atomic_write,
    ensure_dir,
    meta_from_file,
    mmap_fd,
    payload_checksum,
    read_header,
    read_safetensors_metadata,
    tensors_from_map,
)
from .errors import BundleError, CorruptChunkError, SessionExistsError
from .hashing import ChunkHash, chunk_hash, is_chunk_hash, pack_token_ids
from .ids import validate_session_id
from .records import NewChunk, NewMessage, SessionInfo, SessionKV
from .safefile import member_path, open_regular, read_regular

if TYPE_CHECKING:
    import torch

    from .store import Store

BUNDLE_FORMAT = "chatkv.session_bundle"
BUNDLE_VERSION = 1
HISTORY_FILE = "history.json"
KV_FILE = "kv.safetensors"
KV_BUNDLE_FORMAT = "chatkv.session_kv_bundle"
#: Roles a bundle's messages may have; ``system`` only as the first message.
ROLES = ("system", "user", "assistant")
#: safetensors dtypes KV tensors may have, and their names in chunk metadata.
KV_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_TENSOR_KEY = re.compile(r"(\d{6})/(.+)")


@dataclass(frozen=True)
class BundleLimits:
    """Sizes an import accepts, checked before anything is read.

    Attributes:
        max_history_bytes: ``history.json``.
        max_kv_bytes: the KV file; its exact size must also be what its header declares.
        max_header_bytes: the KV file's safetensors header.
        max_archive_bytes: everything an archive may expand to (every
            member's declared size, counted while extracting); default
            ``max_history_bytes + max_kv_bytes``.
        max_members: entries an archive may hold.
    """

    max_history_bytes: int = 64 << 20
    max_kv_bytes: int = 64 << 30
    max_header_bytes: int = 64 << 20
    max_archive_bytes: int | None = None
    max_members: int = 64

    @property
    def archive_bytes(self) -> int:
        """The effective :attr:`max_archive_bytes`."""
        if self.max_archive_bytes is not None:
            return self.max_archive_bytes
        return self.max_history_bytes + self.max_kv_bytes


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
                      "created_at": m.created_at.isoformat(), "partial": m.partial,
                      "outside_window": m.outside_window}
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


def _is_int(v: object) -> bool:
    return type(v) is int  # not bool


def _text(v: object, what: str) -> str:
    _need(isinstance(v, str), f"{what} is not a string")
    assert isinstance(v, str)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise BundleError(f"{what} is not valid Unicode (it holds a lone surrogate)") from None
    return v


def _locate(src: Path) -> tuple[Path, Path]:
    """(bundle directory, its history file) for ``src``: a bundle directory or its ``history.json``."""
    try:
        st = os.stat(src)
    except OSError as e:
        raise BundleError(f"cannot open the bundle {src}: {e.strerror or e}") from e
    if stat.S_ISDIR(st.st_mode):
        return src, src / HISTORY_FILE
    _need(stat.S_ISREG(st.st_mode), f"{src} is not a bundle directory or a history file")
    return src.parent, src


def _load_doc(path: Path, limits: BundleLimits) -> dict[str, Any]:
    if not path.exists() and not path.is_symlink():
        raise BundleError(f"no {HISTORY_FILE} in {path.parent}")
    raw = read_regular(path, limits.max_history_bytes, "the history file")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise BundleError(f"{path} is not readable JSON: {e}") from e
    _need(isinstance(doc, dict) and doc.get("format") == BUNDLE_FORMAT, f"{path} is not a chatkv session bundle")
    _need(doc.get("version") == BUNDLE_VERSION,
          f"bundle version {doc.get('version')!r} is not supported (this chatkv reads {BUNDLE_VERSION})")
    for key, typ in (("session", dict), ("messages", list), ("chunks", list), ("cached_token_ids", list)):
        _need(isinstance(doc.get(key), typ), f"bundle field {key!r} is missing or not a {typ.__name__}")
    sess = doc["session"]
    for key in ("fingerprint", "system_prompt"):
        if sess.get(key) is not None:
            _text(sess[key], f"the session's {key}")
    return doc


def _messages(doc: dict[str, Any]) -> list[NewMessage]:
    """The bundle's messages, validated: known roles, system only first, string content, sane spans."""
    out = []
    for i, m in enumerate(doc["messages"]):
        _need(isinstance(m, dict), f"message {i} is not an object")
        role = m.get("role")
        _need(isinstance(role, str), f"message {i} lacks a string role")
        _need(role in ROLES, f"message {i} has role {role!r}; a bundle may hold only "
                             f"{', '.join(ROLES)} messages")
        _need(role != "system" or i == 0, f"message {i} is a system message; only the first message may be one")
        content = _text(m.get("content"), f"message {i}'s content")
        span = m.get("token_span")
        _need(span is None or (isinstance(span, list) and len(span) == 2 and all(_is_int(t) for t in span)
                               and 0 <= span[0] <= span[1]),
              "a message's token_span is not null or [start, end] with 0 <= start <= end")
        for flag in ("partial", "outside_window"):
            _need(m.get(flag) is None or isinstance(m.get(flag), bool), f"message {i}'s {flag} is not a boolean")
        out.append(NewMessage(role=role, content=content, token_span=(span[0], span[1]) if span else None,
                              partial=bool(m.get("partial")), created_at=_parse_time(m.get("created_at")),
                              outside_window=bool(m.get("outside_window"))))
    return out


def import_session(store: "Store", src: str | os.PathLike[str], *, session_id: str | None = None,
                   overwrite: bool = False, with_kv: bool = True, limits: BundleLimits | None = None) -> SessionInfo:
    """Import a bundle made by :func:`export_session` (untrusted input); return the new session's facts.

    The bundle is validated fully first (see the module docstring: regular
    files inside the bundle only, sizes, roles, KV layout, dtypes, finite
    values, checksums, chained hashes, sha256); then its chunk files are
    written (deduplicated) and the session, its messages and KV links commit
    in one transaction (:meth:`Store.create_session`). Imported KV is
    unverified: the session's ``kv_verified`` is False until the engine
    checks it against the model (:meth:`Store.mark_kv_verified`), except
    chunks the store already holds from the engine itself.

    Args:
        src: the bundle directory, or its ``history.json``.
        session_id: import under this id instead of the bundle's.
        overwrite: replace an existing session of that id, in the same
            transaction, only once the new one is fully validated and its
            files written: a refused or failed import leaves the old one intact.
        with_kv: False imports the history alone (the KV file is not even
            opened); the next turn re-prefills.
        limits: size caps (default :class:`BundleLimits`).

    Raises:
        BundleError: malformed, corrupt, unsafe or unsupported input (nothing is written).
        SessionExistsError: the id exists and ``overwrite`` is false.
        InvalidSessionIdError, SessionLockedError, StorageWriteError.
    """
    limits = limits or BundleLimits()
    base, history = _locate(Path(src))
    doc = _load_doc(history, limits)
    sid = validate_session_id(session_id or doc["session"].get("id"))
    messages = _messages(doc)
    ids: list[int] = []
    new_chunks: list[NewChunk] = []
    fp: str | None = None
    if with_kv:
        ids = doc["cached_token_ids"]
        _need(all(_is_int(t) for t in ids), "cached_token_ids must be integers")
        try:
            pack_token_ids(ids)
        except ValueError as e:
            raise BundleError(str(e)) from e
        if doc["chunks"]:
            fp = doc["session"].get("fingerprint")
            _need(isinstance(fp, str) and fp != "", "a bundle with KV names no fingerprint")
            assert isinstance(fp, str)
            new_chunks = _load_kv(doc, base, fp, ids, limits)
        else:
            _need(not ids, "cached_token_ids given but no chunks")

    if not overwrite and store.has_session(sid):
        raise SessionExistsError(f"session {sid!r} exists; pass overwrite=True or another session_id")
    s_doc = doc["session"]
    try:
        return store.create_session(
            sid, fingerprint=fp if new_chunks else None, system_prompt=s_doc.get("system_prompt"),
            created_at=_parse_time(s_doc.get("created_at")), messages=messages, token_ids=ids if new_chunks else [],
            chunks=new_chunks, replace=overwrite, kv_verified=False)
    except SessionExistsError:
        raise SessionExistsError(f"session {sid!r} exists; pass overwrite=True or another session_id") from None


def _load_kv(doc: dict[str, Any], base: Path, fp: str, ids: list[int], limits: BundleLimits) -> list[NewChunk]:
    """Read and check the bundle's KV file; return its chunks (tensors view a private map of the file)."""
    import torch

    n_chunks = len(doc["chunks"])
    path = member_path(base, doc.get("kv_file"), "kv_file")
    fd, st = open_regular(path, limits.max_kv_bytes, "the KV file")
    try:
        mm, size = mmap_fd(fd)
    except (OSError, ValueError) as e:
        raise BundleError(f"{path.name} is not a readable safetensors file: {e}") from e
    finally:
        os.close(fd)
    n_header = int.from_bytes(mm[:8], "little")
    _need(n_header <= limits.max_header_bytes,
          f"{path.name} declares a {n_header}-byte header, over the limit of {limits.max_header_bytes}")
    digest = hashlib.sha256()
    view = memoryview(mm)
    for at in range(0, size, 1 << 24):
        digest.update(view[at: at + (1 << 24)])
    del view
    _need(digest.hexdigest() == doc.get("kv_sha256"), f"{path.name} does not match its sha256")
    try:
        header, meta, data_start = read_header(mm, size)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BundleError(f"{path.name} is not a readable safetensors file: {e}") from e
    _need(meta.get("format") in (None, KV_BUNDLE_FORMAT), f"{path.name} is not a chatkv KV bundle file")
    layout = _check_layout(header, size - data_start, n_chunks, path.name)
    try:
        all_t = tensors_from_map(mm, size, header, data_start)
    except ValueError as e:
        raise BundleError(f"{path.name} is not a readable safetensors file: {e}") from e

    out: list[NewChunk] = []
    token_tensors: list[torch.Tensor] = []
    shapes: dict[str, list[tuple[int, ...]]] = {}
    counts: list[tuple[int, int]] = []  # (n_tokens, block_size) per chunk
    names: set[str] | None = None
    parent: ChunkHash | None = None
    off = 0
    for i, c in enumerate(doc["chunks"]):
        _need(isinstance(c, dict) and isinstance(c.get("metadata"), dict), f"chunk {i} is malformed")
        md = c["metadata"]
        _need(all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()),
              f"chunk {i}'s metadata must map strings to strings")
        _need(md.get("format") == FORMAT and md.get("format_version") == FORMAT_VERSION,
              f"chunk {i} has unknown format version")
        ts = {name: all_t[key] for name, key in layout.get(i, {}).items()}
        tok = ts.pop(TOKEN_IDS_KEY, None)
        _need(tok is not None and tok.dtype == torch.int32 and tok.dim() == 1, f"chunk {i} has no token ids")
        assert tok is not None
        toks = tok.tolist()
        n = len(toks)
        _need(n > 0 and c.get("n_tokens") == n and md.get("n_tokens") == str(n),
              f"chunk {i}'s token count disagrees with its metadata")
        _need(toks == ids[off: off + n], f"chunk {i}'s tokens differ from cached_token_ids")
        h = c.get("hash")
        _need(is_chunk_hash(h) and md.get("chunk_hash") == h, f"chunk {i} has a bad hash")
        _need(c.get("parent") == parent and (md.get("parent") or None) == parent,
              f"chunk {i} does not name chunk {i - 1} as its parent")
        _need(md.get("fingerprint") == fp, f"chunk {i}'s fingerprint differs from the session's")
        _need(chunk_hash(parent, toks, fp, md.get("kv_format", "")) == h,
              f"chunk {i}'s hash does not chain over its tokens")
        try:
            meta_i = meta_from_file(md)
        except (KeyError, ValueError) as e:
            raise BundleError(f"chunk {i} metadata is incomplete: {e}") from e
        _need(meta_i.block_size > 0, f"chunk {i}'s block_size is not positive")
        _need(bool(ts), f"chunk {i} holds no KV tensors")
        _need(names is None or set(ts) == names, f"chunk {i} holds tensors {sorted(ts)}, not {sorted(names or ())}")
        names = set(ts)
        for name, t in ts.items():
            dtype = str(t.dtype).removeprefix("torch.")
            _need(dtype in KV_DTYPES.values(), f"chunk {i}'s tensor {name!r} is {dtype}, not a float KV dtype")
            _need(dtype == meta_i.dtype, f"chunk {i}'s tensor {name!r} is {dtype} but its metadata says {meta_i.dtype}")
            _need(t.numel() > 0, f"chunk {i}'s tensor {name!r} is empty")
            shapes.setdefault(name, []).append(tuple(t.shape))
        counts.append((n, meta_i.block_size))
        token_tensors.append(tok)
        out.append(NewChunk(n, ts, meta_i))
        parent = ChunkHash(h)
        off += n
    _need(off == len(ids), "chunks do not cover cached_token_ids")
    for name, per_chunk in shapes.items():
        _need(_token_axis(per_chunk, counts) is not None,
              f"tensor {name!r} has shapes {per_chunk[:3]}{'...' if len(per_chunk) > 3 else ''} that do not "
              "follow the chunks' token counts")
    # Last, the checks that read every byte.
    for i, c in enumerate(out):
        ts = {**c.tensors, TOKEN_IDS_KEY: token_tensors[i]}
        md = doc["chunks"][i]["metadata"]
        try:
            checksum, _ = payload_checksum(ts, md.get("checksum", "").partition(":")[0] or None)
        except ValueError as e:
            raise BundleError(f"chunk {i}: {e}") from e
        _need(checksum == md.get("checksum"), f"chunk {i} fails its checksum")
        for name, t in c.tensors.items():
            _need(bool(_finite(t)), f"chunk {i}'s tensor {name!r} holds NaN or infinite values")
    return out


def _finite(t: "torch.Tensor") -> bool:
    import torch

    step = 1 << 24  # elements at a time: bounded temporary memory
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[a: a + step]).all()) for a in range(0, flat.numel(), step))


def _check_layout(header: dict[str, Any], data_bytes: int, n_chunks: int, fname: str) -> dict[int, dict[str, str]]:
    """Check the KV file's tensor entries; return ``{chunk: {name: key}}``.

    Every key is ``<chunk>/<name>`` for a chunk of the bundle, every dtype is
    a KV float dtype or the int32 token ids, and the tensors tile the data
    section exactly (no gaps, no overlap, nothing after): the file is exactly
    as large as its header declares.
    """
    spans = []
    out: dict[int, dict[str, str]] = {}
    for key, e in header.items():
        m = _TENSOR_KEY.fullmatch(key)
        _need(m is not None and int(m.group(1)) < n_chunks, f"{fname} holds tensor {key!r}, which no chunk names")
        assert m is not None
        _need(isinstance(e, dict) and isinstance(e.get("shape"), list) and isinstance(e.get("data_offsets"), list)
              and len(e["data_offsets"]) == 2 and all(_is_int(d) and d >= 0 for d in e["shape"])
              and all(_is_int(o) for o in e["data_offsets"]), f"{fname} has a malformed entry for {key!r}")
        want = "I32" if m.group(2) == TOKEN_IDS_KEY else None
        _need(e.get("dtype") == want if want else e.get("dtype") in KV_DTYPES,
              f"{fname}: tensor {key!r} has dtype {e.get('dtype')!r}; KV must be float32, float16 or bfloat16")
        spans.append((e["data_offsets"][0], e["data_offsets"][1], key))
        out.setdefault(int(m.group(1)), {})[m.group(2)] = key
    at = 0
    for begin, end, key in sorted(spans):
        _need(begin == at and end >= begin, f"{fname}: tensor {key!r} does not follow the one before it")
        at = end
    _need(at == data_bytes, f"{fname} is {data_bytes - at:+d} bytes off the size its header declares")
    return out


def _token_axis(shapes: list[tuple[int, ...]], counts: list[tuple[int, int]]) -> int | None:
    """An axis along which every chunk's extent follows its token count (``n`` tokens, or
    ``ceil(n / block_size)`` blocks) while all other axes agree across chunks; None if there is none."""
    rank = len(shapes[0])
    if any(len(sh) != rank for sh in shapes):
        return None
    for a in range(rank):
        if all(sh[a] in (n, -(-n // bs)) for sh, (n, bs) in zip(shapes, counts)) and \
                all(sh[:a] + sh[a + 1:] == shapes[0][:a] + shapes[0][a + 1:] for sh in shapes):
            return a
    return None


def _parse_time(v: object) -> datetime | None:
    if not isinstance(v, str):
        return None
    try:
        return datetime.fromisoformat(v)
    except ValueError:
        return None
