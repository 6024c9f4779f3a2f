"""One KV chunk as a safetensors file: atomic write, full verification on read.

A chunk file holds the caller's tensors plus ``__token_ids__`` (int32, the
chunk's tokens), so a file alone is enough to recompute its name. Its string
metadata (readable by any safetensors tool):

========================  ==================================================
``format``                ``chatkv.kv_chunk``
``format_version``        ``1``
``chunk_hash``            the file's name, hex sha256 (see :func:`~.hashing.chunk_hash`)
``parent``                parent chunk hash, or empty for a sequence's first chunk
``fingerprint``           model fingerprint the KV belongs to
``kv_format``             the engine's KV layout tag (part of the hash)
``dtype``                 KV dtype, as the caller names it
``block_size``            tokens per block
``n_tokens``              tokens in this chunk
``quant``                 quantization scheme (``none``, ``int8``, ...)
``payload_bytes``         bytes of tensor data
``checksum``              ``xxh3_128:<hex>`` (or ``sha256:<hex>``) over names, dtypes, shapes and bytes
``x.<key>``               caller extras
========================  ==================================================

Only the functions that build or read tensors import torch (and
``safetensors.torch``), on first call; the rest of this module, and the index
side of storage that uses it, loads without them.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash  # imported here, not on the first restore's path (about 1 ms)

from . import nativeread
from .errors import CorruptChunkError, MissingChunkError, StorageWriteError
from .hashing import ChunkHash, chunk_hash, packed_chunk_hash
from .paths import tmp_name

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FORMAT = "chatkv.kv_chunk"
FORMAT_VERSION = "1"
TOKEN_IDS_KEY = "__token_ids__"


@dataclass(frozen=True)
class ChunkMeta:
    """What the caller says about a chunk's tensors (stored as file metadata).

    Attributes:
        fingerprint: the model fingerprint (weights, config, dtype, tokenizer, template, KV format).
        kv_format: the engine's KV layout/version tag; part of the chunk hash.
        dtype: KV dtype name, e.g. ``bfloat16``.
        block_size: tokens per block.
        quant: quantization scheme, ``none`` for full precision.
        extra: more string metadata, stored under ``x.<key>``.
    """

    fingerprint: str
    kv_format: str
    dtype: str
    block_size: int
    quant: str = "none"
    extra: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ChunkFile:
    """A verified chunk read from disk."""

    hash: ChunkHash
    parent: ChunkHash | None
    token_ids: list[int]
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


#: Checksum used for new files. xxh3-128 runs at memory speed (~13 GB/s here
#: against ~1.6 GB/s for sha256), so verifying a restore costs little; it guards
#: against corruption, while the chained sha256 chunk hash names the content.
CHECKSUM_ALGORITHM = "xxh3_128"


def _hasher(algorithm: str) -> Any:
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def payload_checksum(tensors: Mapping[str, torch.Tensor], algorithm: str | None = None) -> tuple[str, int]:
    """Return (``<algorithm>:<hex>``, payload bytes) over tensors in name order
    (``algorithm`` is ``xxh3_128`` or ``sha256``; default :data:`CHECKSUM_ALGORITHM`).
    No side effects."""
    return _digest(algorithm or CHECKSUM_ALGORITHM, {name: _entry(t) for name, t in tensors.items()})


def _entry(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], list[Any]]:
    """A tensor as :func:`_digest` takes it: dtype, shape and its bytes."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    return t.dtype, tuple(t.shape), [flat.view(torch.uint8).numpy().data] if flat.numel() else []


def _digest(algorithm: str, entries: Mapping[str, tuple[torch.dtype, tuple[int, ...], Sequence[Any]]]
            ) -> tuple[str, int]:
    """The payload checksum over ``entries`` (name -> dtype, shape, its bytes as
    buffers in order), in name order: each one's name, dtype and shape, then its
    bytes. Returns (``<algorithm>:<hex>``, bytes). Raises ValueError for an
    unknown algorithm."""
    h = _hasher(algorithm)
    total = _feed(h, entries)
    return f"{algorithm}:" + h.hexdigest(), total


def _feed(h: Any, entries: Mapping[str, tuple[torch.dtype, tuple[int, ...], Sequence[Any]]]) -> int:
    """Hash ``entries`` into ``h`` as :func:`_digest` frames them (name order;
    each one's header, then its bytes); returns the bytes hashed."""
    total = 0
    for name in sorted(entries):
        dtype, shape, buffers = entries[name]
        h.update(_entry_header(name, dtype, shape))
        for buf in buffers:
            h.update(buf)
            total += memoryview(buf).nbytes
    return total


@functools.lru_cache(maxsize=1024)  # (a restore's chunks hash the same few, each read)
def _entry_header(name: str, dtype: Any, shape: tuple[int, ...]) -> bytes:
    """What the payload checksum hashes before a tensor's bytes: its name, dtype and shape."""
    return f"{name}\0{str(dtype)}\0{shape}\n".encode()


def _prepare(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or name == TOKEN_IDS_KEY:
            raise ValueError(f"tensor name {name!r} is not allowed")
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().nbytes() != t.nbytes:  # a view into a bigger buffer
            t = t.clone()
        out[name] = t
    return out


def encode_chunk(
    h: ChunkHash,
    parent: ChunkHash | None,
    token_ids: Sequence[int],
    tensors: Mapping[str, torch.Tensor],
    meta: ChunkMeta,
) -> bytes:
    """Serialize a chunk to safetensors bytes, metadata and checksum included. No side effects."""
    import torch

    payload = _prepare(tensors)
    payload[TOKEN_IDS_KEY] = torch.tensor(list(token_ids), dtype=torch.int32)
    checksum, nbytes = payload_checksum(payload)
    md = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "chunk_hash": h,
        "parent": parent or "",
        "fingerprint": meta.fingerprint,
        "kv_format": meta.kv_format,
        "dtype": meta.dtype,
        "block_size": str(int(meta.block_size)),
        "n_tokens": str(len(token_ids)),
        "quant": meta.quant,
        "payload_bytes": str(nbytes),
        "checksum": checksum,
    }
    for k, v in meta.extra.items():
        md[f"x.{k}"] = str(v)
    return _safetensors_bytes(payload, md)


def _safetensors_bytes(payload: Mapping[str, torch.Tensor], md: Mapping[str, str]) -> bytes:
    """``payload`` (contiguous CPU tensors, the token ids among them) as a
    safetensors file with string metadata ``md``, laid out for the way
    :func:`open_chunk_file` and :meth:`ChunkReader.read_into` read it: the
    token ids right after the header, so that opening a chunk reads both in
    one ``pread``, and the rest front to back.

    ``safetensors.torch.save`` orders tensors by dtype, then name: a compact
    chunk's float32 scales came before its int32 token ids, so opening it
    read the token ids from the middle of the file (about 180 kB in, for an
    int8 chunk of SmolLM2) before the native read went back to the scales
    at its start. Read cold, that jump cost a device round trip of its own
    and broke the kernel's sequential readahead: the pages around the token
    ids came into the page cache as 4 kB folios, which later restores copy
    out at a third of the speed of the large folios a front-to-back read
    leaves. The layout is still safetensors (any order of offsets is valid;
    the checksum covers names in their own order, not the file's), and
    every tensor stays aligned to its item size: 8-byte ones first, then
    the token ids, then the rest by falling item size.
    """
    import torch

    names = {dtype: name for name, dtype in _st_dtypes().items()}

    def rank(name: str) -> tuple[int, int, str]:
        size = payload[name].element_size()
        return (0 if size >= 8 else 1 if name == TOKEN_IDS_KEY else 2, -size, name)

    header: dict[str, Any] = {"__metadata__": dict(md)}
    data: list[Any] = []
    at = 0
    for name in sorted(payload, key=rank):
        t = payload[name]
        if t.dtype not in names:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        if t.nbytes:
            data.append(t.reshape(-1).view(torch.uint8).numpy())
        at += t.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # (the data starts 8-byte aligned, as safetensors writes it)
    return b"".join([len(head).to_bytes(8, "little"), head, *data])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or create inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def ensure_dir(path: Path) -> None:
    """Create ``path`` (and parents) durably. Raises :class:`StorageWriteError` on failure."""
    if path.is_dir():
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        fsync_dir(path.parent)
    except OSError as e:
        raise StorageWriteError(f"cannot create directory {path}: {e.strerror or e}") from e


def atomic_write(path: Path, data: bytes, *, token: str | None = None) -> None:
    """Write ``data`` to ``path`` atomically and durably.

    Temp file in the same directory (named with the writing Store's ``token``,
    see :func:`~.paths.tmp_name`), write, fsync, ``os.replace``, fsync the
    directory. On any error the temp file is removed and ``path`` is untouched.

    Raises:
        StorageWriteError: disk full, read-only file system, or any other OS error.
    """
    ensure_dir(path.parent)
    tmp = path.parent / tmp_name(path.name, token)
    fd = -1
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        _write_all(fd, data)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:  # the failure came before the temp file existed
            pass
        except OSError as cleanup:
            log.warning("could not remove temp file %s after a failed write: %s", tmp, cleanup)
        why = {errno.ENOSPC: "disk full", errno.EROFS: "read-only file system",
               errno.EDQUOT: "quota exceeded", errno.EACCES: "permission denied"}.get(e.errno or 0, "")
        raise StorageWriteError(
            f"cannot write {path.name} in {path.parent}: {why + ': ' if why else ''}{e.strerror or e}"
        ) from e


@functools.cache
def _st_dtypes() -> dict[str, torch.dtype]:
    """The torch dtype of each safetensors dtype name (one dict, made once: do not change it)."""
    import torch

    return {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    }


def _read_header(buf: Any, size: int) -> tuple[dict[str, Any], dict[str, str], int]:
    """Parse a safetensors header from ``buf`` (bytes-like, ``size`` bytes long).

    Returns (tensor entries, string metadata, offset of the data section).
    Raises ValueError on a malformed header.
    """
    if size < 8:
        raise ValueError(f"{size} bytes is too short for a safetensors file")
    n = int.from_bytes(bytes(buf[:8]), "little")
    if n <= 0 or 8 + n > size:
        raise ValueError(f"header length {n} does not fit the {size}-byte file")
    header = json.loads(bytes(buf[8 : 8 + n]))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("metadata must map strings to strings")
    return header, dict(meta), 8 + n


def read_safetensors_metadata(path: Path) -> dict[str, str]:
    """The string metadata of a safetensors file, read from its header alone.

    Reads only the header (no tensor bytes) and needs no torch. Pure read.

    Raises:
        ValueError: a malformed header.
        OSError: the file cannot be read (``FileNotFoundError`` if missing).
    """
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        buf = head + fh.read(n) if 0 < n <= size - 8 else head  # _read_header rejects a bad length
    _, meta, _ = _read_header(buf, size)
    return meta


def map_safetensors(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Open a safetensors file as read-only tensors that view a memory map of it.

    Zero-copy: bytes are read from the page cache when a tensor is used (e.g.
    copied into the block pool), so a restore copies each byte once. The map is
    private (copy on write), so writing to a tensor never changes the file.
    Every header field is validated.

    Raises:
        ValueError: a malformed header, unknown dtype, or offsets outside the file.
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as fh:
        mm, size = mmap_fd(fh.fileno())
    header, meta, base = _read_header(mm, size)
    return meta, tensors_from_map(mm, size, header, base)


def mmap_fd(fd: int) -> tuple[Any, int]:
    """A private (copy-on-write) memory map of the open file ``fd`` and its size.

    Raises:
        ValueError: the file is shorter than a safetensors header.
    """
    import mmap

    size = os.fstat(fd).st_size
    if size < 8:
        raise ValueError(f"{size} bytes is too short for a safetensors file")
    # Copy-on-write: reading shares the page cache; a stray write would touch a
    # private page, never the file (and never fault).
    return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY), size


def read_header(buf: Any, size: int) -> tuple[dict[str, Any], dict[str, str], int]:
    """Parse a safetensors header: (tensor entries, string metadata, offset of the data). Raises ValueError."""
    return _read_header(buf, size)


def tensors_from_map(mm: Any, size: int, header: Mapping[str, Any], base: int) -> dict[str, torch.Tensor]:
    """Tensors viewing ``mm`` as ``header`` (parsed by :func:`read_header`) describes them.

    Raises:
        ValueError: an unknown dtype or offsets outside or inconsistent with the buffer.
    """
    import torch

    tensors: dict[str, torch.Tensor] = {}
    for name, (dtype, shape, begin, end) in _entries(header, base, size).items():
        if begin == end:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=end - begin, offset=base + begin)
        tensors[name] = flat.view(dtype).reshape(shape)
    return tensors


def _entries(header: Mapping[str, Any], base: int, size: int
             ) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """Each tensor of a parsed safetensors ``header`` as ``(dtype, shape, begin,
    end)`` (offsets into the data section), every field checked against a file
    of ``size`` bytes whose data section starts at ``base``.

    Raises:
        ValueError: an unknown dtype or offsets outside or inconsistent with the file.
    """
    st_dtypes = _st_dtypes()
    out: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    for name, info in header.items():
        dtype = st_dtypes.get(info.get("dtype")) if type(info) is dict else None
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if dtype is not None else (None, None)
        try:  # (a product of JSON numbers is an int only where every one is; of a string, a string)
            begin, end = offsets if type(offsets) is list else ()
            count = math.prod(shape) if type(shape) is list else None
        except (TypeError, ValueError):
            count = None
        if type(count) is not int or type(begin) is not int or type(end) is not int:
            raise ValueError(f"bad header entry for tensor {name!r}")
        if min(shape, default=0) < 0 or not 0 <= begin <= end or base + end > size \
                or end - begin != count * dtype.itemsize:
            raise ValueError(f"tensor {name!r} has offsets {offsets} outside or inconsistent with the file")
        out[name] = (dtype, tuple(shape), begin, end)
    return out


def _checked_size(path: Path, expected_hash: ChunkHash, expected_bytes: int | None) -> int:
    """The file's size, checked against the index's; raises Missing/CorruptChunkError."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise MissingChunkError(expected_hash, f"file {path} is missing") from None
    return _check_size(size, expected_hash, expected_bytes)


def _check_size(size: int, expected_hash: ChunkHash, expected_bytes: int | None) -> int:
    """``size`` (a chunk file's), checked against the index's ``expected_bytes``
    (None: not known); raises CorruptChunkError where they differ."""
    if expected_bytes is not None and size != expected_bytes:
        raise CorruptChunkError(expected_hash, f"size is {size} bytes, the index says {expected_bytes}")
    return size


def _checked_identity(md: Mapping[str, str], token_ids: list[int] | None, expected_hash: ChunkHash,
                      fingerprint: str | None, verify: bool, packed: bytes | None = None,
                      ) -> tuple[list[int], ChunkHash | None]:
    """Check a chunk's format, name, fingerprint and token ids (``token_ids``:
    its int32 token id vector, None where it has none; ``packed``: the same
    as the file holds them, where the caller has them) and, with ``verify``,
    that its chained hash follows from them; returns ``(token ids, parent)``.

    Raises:
        CorruptChunkError: any check failed.
    """
    if md.get("format") != FORMAT or md.get("format_version") != FORMAT_VERSION:
        raise CorruptChunkError(
            expected_hash, f"format {md.get('format')!r} v{md.get('format_version')!r}, expected {FORMAT} v{FORMAT_VERSION}"
        )
    if md.get("chunk_hash") != expected_hash:
        raise CorruptChunkError(expected_hash, f"file says it is chunk {md.get('chunk_hash')!r}")
    if fingerprint is not None and md.get("fingerprint") != fingerprint:
        raise CorruptChunkError(expected_hash, f"fingerprint {md.get('fingerprint')!r}, expected {fingerprint!r}")
    if token_ids is None:
        raise CorruptChunkError(expected_hash, "no int32 token id vector")
    if str(len(token_ids)) != md.get("n_tokens"):
        raise CorruptChunkError(expected_hash, f"{len(token_ids)} token ids, metadata says {md.get('n_tokens')}")
    parent = ChunkHash(md["parent"]) if md.get("parent") else None
    if verify:
        try:
            fp, kv_format = md.get("fingerprint", ""), md.get("kv_format", "")
            again = (chunk_hash(parent, token_ids, fp, kv_format) if packed is None
                     else packed_chunk_hash(parent, packed, fp, kv_format))
        except ValueError as e:
            raise CorruptChunkError(expected_hash, str(e)) from e
        if again != expected_hash:
            raise CorruptChunkError(expected_hash, "chained hash does not match the tokens")
    return token_ids, parent


def _verify_checksum(md: Mapping[str, str], entries: Mapping[str, tuple[torch.dtype, tuple[int, ...], Sequence[Any]]],
                     expected_hash: ChunkHash) -> None:
    """Raise :class:`CorruptChunkError` unless the tensors of ``entries`` (see
    :func:`_digest`) match the file's payload checksum."""
    h = _file_hasher(md, expected_hash)
    _feed(h, entries)
    _check_checksum(md, h, expected_hash)


def _file_hasher(md: Mapping[str, str], expected_hash: ChunkHash) -> Any:
    """A fresh hasher of the algorithm the file's ``checksum`` metadata names.

    Raises:
        CorruptChunkError: no checksum, or an unknown algorithm.
    """
    try:
        return _hasher((md.get("checksum") or "").partition(":")[0])
    except ValueError as e:
        raise CorruptChunkError(expected_hash, str(e)) from e


def _check_checksum(md: Mapping[str, str], h: Any, expected_hash: ChunkHash) -> None:
    """Raise :class:`CorruptChunkError` unless ``h`` (:func:`_file_hasher`, fed
    the whole payload) gives the file's ``checksum``."""
    _check_hexdigest(md, h.hexdigest(), expected_hash)


def _check_hexdigest(md: Mapping[str, str], hexdigest: str, expected_hash: ChunkHash) -> None:
    """Raise :class:`CorruptChunkError` unless ``hexdigest`` (of the algorithm
    the file names, over the whole payload) is the file's ``checksum``."""
    algorithm = (md.get("checksum") or "").partition(":")[0]
    if f"{algorithm}:{hexdigest}" != md.get("checksum"):
        raise CorruptChunkError(expected_hash, "payload checksum mismatch")


def read_chunk_file(
    path: Path,
    expected_hash: ChunkHash,
    *,
    expected_bytes: int | None = None,
    fingerprint: str | None = None,
    verify: bool = True,
) -> ChunkFile:
    """Read and verify one chunk file. Pure read; no side effects.

    Checks, in order: the file exists, its size equals ``expected_bytes``
    (when given), safetensors can parse it, the format tag and version, the
    stored hash equals ``expected_hash``, ``fingerprint`` (when given), the
    token count and, when ``verify``, the payload checksum and the chained hash
    recomputed from parent + token ids + fingerprint + kv_format.

    Raises:
        MissingChunkError: no file.
        CorruptChunkError: any other check failed (the caller quarantines).
    """
    import torch

    _checked_size(path, expected_hash, expected_bytes)
    try:
        md, tensors = map_safetensors(path)
    except (OSError, ValueError) as e:
        raise CorruptChunkError(expected_hash, f"not a readable safetensors file ({e})") from e
    ids_t = tensors.pop(TOKEN_IDS_KEY, None)
    ids = ids_t.tolist() if ids_t is not None and ids_t.dtype == torch.int32 and ids_t.dim() == 1 else None
    token_ids, parent = _checked_identity(md, ids, expected_hash, fingerprint, verify)
    if verify:
        _verify_checksum(md, {name: _entry(t) for name, t in {**tensors, TOKEN_IDS_KEY: ids_t}.items()},
                         expected_hash)
    return ChunkFile(expected_hash, parent, token_ids, tensors, md)


@dataclass(frozen=True)
class Converted:
    """A tensor that :meth:`ChunkReader.read_into` converts as it reads it
    (where :meth:`ChunkReader.converts`): its elements (int8, float8 e4m3fn,
    float16, bfloat16 or float32 in the file), each row of ``row`` of them
    multiplied by that row's float32 in the chunk's tensor ``scale`` (None:
    not scaled), computed in float32 and rounded once (to nearest even) to
    ``dtype`` (float32 or bfloat16), fill ``buffers`` in order: writable,
    C-contiguous, together exactly the tensor's elements in ``dtype``, each
    whole rows (or one :class:`~.nativeread.Spans` or
    :class:`~.nativeread.PlaneSpans`, each stretch whole
    rows). What a quantized tensor dequantizes to, without its codes ever
    being in memory whole (see :mod:`.nativeread`).

    With ``zero``, the tensor is uint8, two 4-bit codes a byte (the low
    nibble first, ``row // 2`` bytes a row), and each element is ``code *
    scale + zero``, each step rounded in float32, with float16 tensors
    ``scale`` and ``zero`` holding either a row of them per ``block`` rows
    or ``row // group`` of them per row.
    """

    buffers: Sequence[Any]
    dtype: torch.dtype
    row: int
    scale: str | None = None
    zero: str | None = None
    block: int = 0
    group: int = 0


class ChunkReader:
    """A chunk file whose header, name, fingerprint and token ids are checked,
    and whose tensors are read on demand straight into memory the caller names.

    Made by :func:`open_chunk_file`; a context manager (closes the file). Where
    :func:`read_chunk_file` maps the file and leaves the caller to copy the
    tensors where they belong, :meth:`read_into` reads each tensor's bytes with
    ``preadv`` into the caller's buffers (a block pool's slots, say): one copy
    from the page cache, with no page faults on a mapping, the payload
    checksum taken over each slice where it landed, as it lands.

    Attributes:
        hash, parent, token_ids, metadata: as in :class:`ChunkFile`.
        shapes: each tensor's ``(dtype, shape)`` but the token ids', from the header.
    """

    def __init__(self, fd: int, expected_hash: ChunkHash,
                 entries: Mapping[str, tuple[torch.dtype, tuple[int, ...], int, int]], base: int,
                 metadata: dict[str, str], token_ids: list[int], parent: ChunkHash | None,
                 ids_bytes: bytes) -> None:
        """Use :func:`open_chunk_file` (``ids_bytes``: the token ids as the file holds them)."""
        import torch

        self._fd = fd
        self.hash = expected_hash
        self.parent = parent
        self.token_ids = token_ids
        self.metadata = metadata
        # What the payload checksum hashes for the token ids (see _feed).
        self._ids_entry = (_entry_header(TOKEN_IDS_KEY, torch.int32, (len(token_ids),)),
                           [ids_bytes] if ids_bytes else [])
        self._spans = {name: (base + begin, end - begin) for name, (_, _, begin, end) in entries.items()}
        self._base = base
        # What a templated read's layout depends on (see _templated).
        self._layout = (tuple(entries.items()), len(ids_bytes))
        self.shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            name: (dtype, shape) for name, (dtype, shape, _, _) in entries.items()}

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # a reader dropped unread still gives its descriptor back
        self.close()

    def __enter__(self) -> "ChunkReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def converts(self) -> bool:
        """Whether :meth:`read_into` can convert tensors as it reads them
        (``converted``): the native reads are ready (:func:`.nativeread.reader`)
        and the file's checksum is the xxh3-128 they compute."""
        return nativeread.reader() is not None and (self.metadata.get("checksum") or "").startswith("xxh3_128:")

    def read_into(self, buffers: Mapping[str, Sequence[Any]], *, verify: bool = True,
                  converted: Mapping[str, Converted] | None = None) -> dict[str, torch.Tensor]:
        """Read every tensor: each one named in ``buffers`` into those writable
        buffers (bytes-like, C-contiguous), which it fills in order and which
        together hold exactly its bytes (or into one :class:`~.nativeread.Spans`
        or :class:`~.nativeread.PlaneSpans`,
        its stretches filled in order); each one named in ``converted`` as
        that says (only where :meth:`converts`; its scales and offsets are
        read first);
        every other one into new memory. With ``verify``, check the payload
        checksum over what was read, fed a slice (:data:`HASHED_READ_BYTES`)
        at a time as each one lands.

        Returns:
            The tensors read into new memory, by name (not those in ``buffers``
            or ``converted``; the scales and offsets of ``converted`` among them).

        Raises:
            ValueError: ``buffers`` or ``converted`` names an unknown tensor, or one
                that does not add up to its size or cannot be converted so, or
                ``converted`` is given where :meth:`converts` is False; nothing
                was read.
            CorruptChunkError: the file ends early or the checksum does not match;
                the caller's buffers then hold unverified bytes.
        """
        import torch

        converted = converted or {}
        if converted:
            read = self._templated(buffers, converted)
            if read is not None:
                return read.run(self, buffers, converted, verify)
        plans, scales = self._checked(buffers, converted)
        fresh: dict[str, torch.Tensor] = {}
        arrays: dict[str, Any] = {}  # fresh ones numpy made, by name (numpy views of them)
        views: dict[str, list[memoryview]] = {}
        for name, (_, nbytes) in self._spans.items():
            if name in converted:
                continue
            if name in buffers:
                given = buffers[name]
                bufs = [given] if isinstance(given, nativeread.STRETCHES) else [memoryview(b).cast("B") for b in given]
                if sum(nativeread.nbytes_of(b) for b in bufs) != nbytes:
                    raise ValueError(f"buffers for tensor {name!r} hold {sum(nativeread.nbytes_of(b) for b in bufs)} "
                                     f"bytes, the tensor {nbytes}")
            else:
                fresh[name], arrays[name] = _fresh(*self.shapes[name])
                bufs = [memoryview(arrays[name]).cast("B")] if nbytes else []
            views[name] = bufs
        if converted:  # only the native reads convert
            # The scales and offsets read first, by the same native call (not hashed
            # then), before the tensors they scale; hashed from memory in their turn.
            unhashed = self._unhashed(scales, views)
            plans = {name: (bufs, self._scaled(convert, converted[name], arrays))
                     for name, (bufs, convert) in plans.items()}
            plan = self._checksum_plan(views, plans, set(scales))
            hexdigest = self._read_native(nativeread.reader(), plan, unhashed)  # type: ignore[arg-type]
            if verify:
                _check_hexdigest(self.metadata, hexdigest, self.hash)
            return fresh
        if not verify:
            for name, bufs in views.items():
                _preadv_all(self._fd, _plain(bufs), self._spans[name][0], self.hash)
            return fresh
        # In the checksum's order (names sorted, the token ids among them), each
        # tensor read a slice at a time and hashed while the slice is still in
        # the core's cache, but those _read_first names: read before, whole, and
        # hashed from memory in their turn. Hashing whole chunks from memory after
        # reading them took a fifth of a restore (12.3 against 9.9 ms at 1.9k tokens).
        early = self._read_first(fresh) if fresh else []
        plan = self._checksum_plan(views, in_memory=set(early))
        h = _file_hasher(self.metadata, self.hash)
        native = nativeread.reader() if isinstance(h, xxhash.xxh3_128) else None
        if native is not None:  # the same reads and digest in one call, without the GIL
            unhashed = self._unhashed(early, views)
            _check_hexdigest(self.metadata, self._read_native(native, plan, unhashed), self.hash)
            return fresh
        for name in early:
            _preadv_all(self._fd, views[name], self._spans[name][0], self.hash)
        for header, bufs, offset, _ in plan:
            h.update(header)
            if offset is None:
                for b in bufs:
                    h.update(b)
            else:
                _read_hashed(self._fd, _plain(bufs), offset, self.hash, h)
        _check_checksum(self.metadata, h, self.hash)
        return fresh

    def _checked(self, buffers: Mapping[str, Any], converted: Mapping[str, Converted],
                 ) -> tuple[dict[str, tuple[list[Any], nativeread.Convert]], list[str]]:
        """:meth:`read_into`'s checks of the names it is given: each converted
        tensor's :meth:`_conversion`, by name, and the names of the scales
        and offsets they need (read into new memory), in the order they lie
        in the file.

        That order is the order they are read in: a file read cold is then
        read front to back (the scales, then the codes after them), which the
        kernel's readahead brings into the page cache in large folios. Read
        in a set's order (int4's four, jumping back and forth), a chunk's
        file came in as 4 kB pages, which later reads copied out of the page
        cache at a third of the speed or less (7 to 10 against 23 to 24
        GB/s, this project's VM; ``/proc/kpageflags`` showed 94% of the
        pages in 4 kB folios, against 1%).

        Raises:
            ValueError: an unknown tensor, a conversion that does not fit, or
                scales named among ``buffers`` or ``converted``.
        """
        unknown = (set(buffers) | set(converted)) - set(self.shapes)
        if unknown:
            raise ValueError(f"chunk {self.hash[:12]} has no tensor {sorted(unknown)}")
        plans = {name: self._conversion(name, c) for name, c in converted.items()}
        scales = {p for c in converted.values() for p in (c.scale, c.zero) if p is not None}
        if scales & (set(buffers) | set(converted)):
            raise ValueError(f"scales {sorted(scales & (set(buffers) | set(converted)))} are read into new memory, "
                             "not into buffers or converted")
        return plans, self._in_file_order(scales)

    def _read_first(self, fresh: Collection[str]) -> list[str]:
        """Of the tensors read into new memory (``fresh``), those a read
        takes first, unhashed, in the order they lie in the file (hashed
        from memory in their turn): each that lies before a tensor the
        checksum takes ahead of it. The rest are then read in the checksum's
        order (names sorted), which for chatkv's chunks is the file's, so
        that the file is read front to back. A compact chunk read into
        memory (a pool not in host memory, or a chunk the loop fills) has
        its scales and offsets, near the file's start, taken first so; read in
        the checksum's order, its reads jumped from codes back to scales,
        and read cold it came into the page cache as 4 kB pages (see
        :meth:`_checked`)."""
        early: list[str] = []
        end = 0  # where the last tensor read in the checksum's order ends
        for name in sorted(self._spans):
            at, nbytes = self._spans[name]
            if not nbytes:
                continue
            if at >= end:
                end = at + nbytes
            elif name in fresh:
                early.append(name)
        return self._in_file_order(early)

    def _in_file_order(self, names: Collection[str]) -> list[str]:
        """Tensors ``names`` sorted by where they lie in the file (see :meth:`_checked` for why)."""
        return sorted(names, key=lambda name: self._spans[name][0])

    def _unhashed(self, names: Sequence[str], views: Mapping[str, list[memoryview]]) -> list[tuple[Any, int, None]]:
        """The native read's pieces that read tensors ``names`` (each read into
        new memory, one view, or none where it is empty) whole, in order, not
        hashed: hashed from memory in their turn in the checksum's order."""
        return [(v, self._spans[name][0], None) for name in names for v in views[name]]

    def _templated(self, buffers: Mapping[str, Any], converted: Mapping[str, Converted]) -> "_TemplatedRead | None":
        """The :class:`_TemplatedRead` of this converted read where it can be
        one (the native reads ready, an xxh3-128 checksum, every destination
        a :class:`~.nativeread.PlaneSpans` or an empty list, every tensor
        read into memory of a type numpy has): made and checked the first
        time its layout comes, then kept (a restore's full chunks share
        one). None otherwise (:meth:`read_into` then builds the read afresh).

        Raises:
            ValueError: the read does not fit the chunk (as :meth:`read_into`).
        """
        native = nativeread.reader()
        if native is None or not (self.metadata.get("checksum") or "").startswith("xxh3_128:"):
            return None
        spans = nativeread.PlaneSpans
        key: list[Any] = [self._layout]
        for name, c in converted.items():
            b = c.buffers
            if type(b) is not spans:
                return None
            key.append(("converted", name, c.dtype, c.row, c.scale, c.zero, c.block, c.group, b.hi - b.lo,
                        len(b.starts)))
        for name, b in buffers.items():
            if type(b) is spans:
                key.append(("into", name, b.hi - b.lo, len(b.starts)))
            elif type(b) is list and not b:
                key.append(("into", name, 0, 0))
            else:
                return None
        frozen = tuple(key)
        read = _TEMPLATED.get(frozen, _UNMADE)
        if read is _UNMADE:
            read = _TemplatedRead.make(self, buffers, converted)
            if len(_TEMPLATED) >= _TEMPLATED_MOST:
                _TEMPLATED.clear()
            _TEMPLATED[frozen] = read
        return read

    def _conversion(self, name: str, converted: Converted) -> tuple[list[Any], nativeread.Convert]:
        """``converted``'s buffers as C-contiguous byte views, and their
        conversion for tensor ``name`` (without scales: see :meth:`_scaled`).

        Raises:
            ValueError: it cannot be converted so, or :meth:`converts` is False.
        """
        import torch

        if not self.converts():
            raise ValueError(f"chunk {self.hash[:12]}: converted reads need the native reads and an xxh3-128 "
                             "checksum")
        dtype, shape = self.shapes[name]
        nibbles = converted.zero is not None
        source = "uint4x2" if nibbles and dtype == torch.uint8 else str(dtype).removeprefix("torch.")
        target = str(converted.dtype).removeprefix("torch.")
        if source not in nativeread.SOURCE_TYPES or target not in nativeread.TARGET_TYPES \
                or nibbles != (source == "uint4x2"):
            raise ValueError(f"no conversion of tensor {name!r} from {source} to {target}")
        count = math.prod(shape) * (2 if nibbles else 1)
        row, target_size = converted.row, nativeread.TARGET_TYPES[target][1]
        if isinstance(converted.buffers, nativeread.STRETCHES):
            bufs = [converted.buffers]
        else:
            bufs = [memoryview(b).cast("B") for b in converted.buffers]
        # (That each buffer, or stretch, is whole rows the native reads check, before reading.)
        if row < 1 or count % row or sum(nativeread.nbytes_of(b) for b in bufs) != count * target_size:
            raise ValueError(f"buffers for tensor {name!r} do not hold its {count} elements as whole rows of "
                             f"{row} {target}")
        rows = count // row
        if nibbles:
            if converted.scale is None or (converted.block > 0) == (converted.group > 0) \
                    or (converted.block and rows % converted.block) or (converted.group and row % converted.group):
                raise ValueError(f"tensor {name!r}: 4-bit codes need scales and either whole blocks or groups")
            per = rows // converted.block * row if converted.block else rows * row // converted.group
            self._check_parameters(name, converted.scale, torch.float16, per)
            self._check_parameters(name, converted.zero, torch.float16, per)
        elif converted.scale is not None:
            self._check_parameters(name, converted.scale, torch.float32, rows)
        return bufs, nativeread.Convert(source, target, row, block=converted.block, group=converted.group)

    def _check_parameters(self, name: str, parameters: str, dtype: torch.dtype, count: int) -> None:
        """Raise ValueError unless tensor ``parameters`` holds ``count`` of ``dtype`` (for tensor ``name``)."""
        if self.shapes.get(parameters, (None, ()))[0] != dtype:
            raise ValueError(f"chunk {self.hash[:12]} has no {str(dtype).removeprefix('torch.')} tensor "
                             f"{parameters!r}")
        held = math.prod(self.shapes[parameters][1])
        if held != count:
            raise ValueError(f"tensor {parameters!r} holds {held} values, not the {count} that {name!r} needs")

    @staticmethod
    def _scaled(convert: nativeread.Convert, converted: Converted, arrays: Mapping[str, Any]) -> nativeread.Convert:
        """``convert`` (:meth:`_conversion`) given the scales and offsets that
        ``converted`` names, read into ``arrays`` (numpy arrays, by name)."""
        if converted.scale is None:
            return convert
        zero = None if converted.zero is None else arrays[converted.zero].reshape(-1)
        return nativeread.Convert(convert.source, convert.target, convert.row, arrays[converted.scale].reshape(-1),
                                  zero, convert.block, convert.group)

    def _checksum_plan(self, views: Mapping[str, list[memoryview]],
                       converted: Mapping[str, tuple[list[Any], nativeread.Convert]] | None = None,
                       in_memory: set[str] | None = None,
                       ) -> list[tuple[bytes, Sequence[Any], int | None, nativeread.Convert | None]]:
        """What the payload checksum covers, in its order (:func:`_feed`'s):
        for each tensor, ``(its header, the buffers its bytes go to or are
        in, its offset in the file, how they are converted or None)``,
        the offset None for the token ids and the tensors ``in_memory``
        (already read: hashed, not read again)."""
        converted = converted or {}
        in_memory = in_memory or set()
        plan: list[tuple[bytes, Sequence[Any], int | None, nativeread.Convert | None]] = []
        for name in sorted([*views, *converted, TOKEN_IDS_KEY]):
            if name == TOKEN_IDS_KEY:
                plan.append((*self._ids_entry, None, None))
                continue
            header = _entry_header(name, *self.shapes[name])
            if name in converted:
                bufs, convert = converted[name]
                plan.append((header, bufs, self._spans[name][0], convert))
            else:
                plan.append((header, views[name], None if name in in_memory else self._spans[name][0], None))
        return plan

    def _read_native(self, native: nativeread.NativeReads,
                     plan: list[tuple[bytes, Sequence[Any], int | None, nativeread.Convert | None]],
                     unhashed: Sequence[tuple[Any, int, None]] = ()) -> str:
        """:meth:`read_into`'s reads and payload checksum through ``native``
        (:mod:`.nativeread`): ``unhashed`` (``(buffer, offset, None)``
        pieces, read and not hashed), then ``plan`` (:meth:`_checksum_plan`)
        as pieces, in one call. Returns the hex digest. Raises
        CorruptChunkError at an early end."""
        pieces: list[tuple[Any, ...]] = list(unhashed)
        for header, bufs, offset, convert in plan:
            pieces.append((header, -1))
            first = 0
            for b in bufs:
                if offset is None:  # hashed only
                    pieces.append((b, -1))
                elif convert is None:
                    pieces.append((b, offset))
                    offset += nativeread.nbytes_of(b)
                else:  # the buffer's rows are the tensor's rows from ``first``
                    rows = nativeread.nbytes_of(b) // (nativeread.TARGET_TYPES[convert.target][1] * convert.row)
                    pieces.append((b, offset, convert, first))
                    first += rows
                    offset += rows * convert.row * nativeread.SOURCE_TYPES[convert.source][1] // 8
        try:
            return native.read_hashed(self._fd, pieces, HASHED_READ_BYTES)
        except EOFError:
            raise CorruptChunkError(self.hash, "the file ends before its tensors do") from None


class _TemplatedRead:
    """A converted :meth:`ChunkReader.read_into` worked out once for a layout
    of chunk and destinations (:meth:`ChunkReader._templated`), run for each
    chunk that has it: its pieces a :class:`~.nativeread.PieceTemplate`, the
    tensors read into memory in one scratch buffer a call, the bytes only
    hashed (the tensors' headers and the token ids) in one blob. The same
    reads, checks and checksum, in the same order, as the read built afresh.
    """

    def __init__(self, template: nativeread.PieceTemplate, before: bytes, after: bytes, scratch: int,
                 fresh: list[tuple[str, int, int, Any, tuple[int, ...]]], dests: list[tuple[bool, str]]) -> None:
        """See :meth:`make`."""
        self.template = template
        self.before, self.after = before, after  # the blob's bytes before and after the token ids
        self.scratch = scratch
        self.fresh = fresh  # (name, at, bytes, numpy dtype, shape) of each tensor read into the scratch
        self.dests = dests  # (converted?, name) of each destination, in the template's order

    @classmethod
    def make(cls, reader: ChunkReader, buffers: Mapping[str, Any], converted: Mapping[str, Converted],
             ) -> "_TemplatedRead | None":
        """The read of ``converted`` and ``buffers`` (each a PlaneSpans or an
        empty list) from ``reader``'s layout, after every check
        :meth:`ChunkReader.read_into` makes; None where a tensor read into
        memory has no numpy dtype.

        Raises:
            ValueError: as :meth:`ChunkReader.read_into`.
        """
        import numpy as np

        plans, scales = reader._checked(buffers, converted)
        numpy_dtypes = _numpy_dtypes()
        fresh: list[tuple[str, int, int, Any, tuple[int, ...]]] = []
        at = 0
        for name, (_, nbytes) in reader._spans.items():
            if name in buffers:
                held = buffers[name].nbytes if buffers[name] else 0  # (a PlaneSpans or an empty list)
                if held != nbytes:
                    raise ValueError(f"buffers for tensor {name!r} hold {held} bytes, the tensor {nbytes}")
            elif name not in converted:
                dtype, shape = reader.shapes[name]
                if dtype not in numpy_dtypes:
                    return None
                fresh.append((name, at, nbytes, numpy_dtypes[dtype], shape))
                at += -(-nbytes // 64) * 64  # (each one aligned for any dtype)
        scratch = np.empty(at, dtype=np.uint8)
        address = scratch.ctypes.data
        arrays = {name: scratch[a: a + n].view(dt).reshape(shape) for name, a, n, dt, shape in fresh}
        where = {name: (a, n) for name, a, n, _, _ in fresh}
        template = nativeread.PieceTemplate()
        base = reader._base
        for name in scales:  # read first, not hashed; hashed from memory in their turn
            a, n = where[name]
            if n:
                template.add_read(a, n, reader._spans[name][0] - base, hashed=False)
        blob: list[bytes] = []
        ids_at = -1
        dests: list[tuple[bool, str]] = []

        def hash_in_blob(data: bytes) -> None:
            if data:
                template.add_hashed(sum(map(len, blob)), len(data), in_blob=True)
                blob.append(data)

        # In the checksum's order (_checksum_plan's: names sorted, the token ids among them).
        for name in sorted([*reader._spans, TOKEN_IDS_KEY]):
            if name == TOKEN_IDS_KEY:
                header, ids = reader._ids_entry
                hash_in_blob(header)
                ids_at = len(blob)
                if ids:
                    hash_in_blob(ids[0])
                continue
            hash_in_blob(_entry_header(name, *reader.shapes[name]))
            offset = reader._spans[name][0] - base
            if name in converted:
                (dest,), convert = plans[name]
                if dest.nbytes:
                    template.add_into(len(dests), dest.nbytes, offset,
                                      reader._scaled(convert, converted[name], arrays), address)
                    dests.append((True, name))
            elif name in buffers:
                dest = buffers[name]
                if dest and dest.nbytes:
                    template.add_into(len(dests), dest.nbytes, offset)
                    dests.append((False, name))
            else:
                a, n = where[name]
                if not n:
                    continue
                if name in scales:
                    template.add_hashed(a, n, in_blob=False)
                else:
                    template.add_read(a, n, offset, hashed=True)
        before = b"".join(blob[:ids_at])
        after = b"".join(blob[ids_at + 1:] if reader._ids_entry[1] else blob[ids_at:])
        return cls(template, before, after, at, fresh, dests)

    def run(self, reader: ChunkReader, buffers: Mapping[str, Any], converted: Mapping[str, Converted],
            verify: bool) -> dict[str, torch.Tensor]:
        """:meth:`ChunkReader.read_into` of ``buffers`` and ``converted``
        (whose layout this was made for) from ``reader``.

        Raises:
            ValueError: a destination converted into is not whole rows (nothing was read).
            CorruptChunkError: as :meth:`ChunkReader.read_into`.
        """
        import numpy as np
        import torch

        scratch = np.empty(self.scratch, dtype=np.uint8)
        ids = reader._ids_entry[1]
        blob = self.before + ids[0] + self.after if ids else self.before + self.after
        dests = [converted[name].buffers if into else buffers[name] for into, name in self.dests]
        fields = self.template.fields(reader._base, scratch.ctypes.data, nativeread.bytes_address(blob), dests)
        native = nativeread.reader()
        try:
            hexdigest = native.read_fields(reader._fd, fields, HASHED_READ_BYTES)  # type: ignore[union-attr]
        except EOFError:
            raise CorruptChunkError(reader.hash, "the file ends before its tensors do") from None
        if verify:
            _check_hexdigest(reader.metadata, hexdigest, reader.hash)
        return {name: torch.from_numpy(scratch[a: a + n].view(dt).reshape(shape))
                for name, a, n, dt, shape in self.fresh}


#: The templated reads made so far, by layout (:meth:`ChunkReader._templated`).
_TEMPLATED: dict[tuple[Any, ...], _TemplatedRead | None] = {}
_TEMPLATED_MOST = 64
_UNMADE = object()


def open_chunk_file(
    path: Path | str,
    expected_hash: ChunkHash,
    *,
    expected_bytes: int | None = None,
    fingerprint: str | None = None,
) -> ChunkReader:
    """Open one chunk file for :meth:`ChunkReader.read_into`, reading only its
    header and token ids and making every check :func:`read_chunk_file` makes
    but the payload checksum (which ``read_into`` makes). Pure read.

    Raises:
        MissingChunkError: no file.
        CorruptChunkError: any other check failed (the caller quarantines).
    """
    import numpy as np
    import torch

    # No torch operators here, and as few system calls as can be: a restore's
    # readers open chunks side by side, and each such call gives the GIL away
    # and waits for it back.
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise MissingChunkError(expected_hash, f"file {path} is missing") from None
    except OSError as e:
        raise CorruptChunkError(expected_hash, f"cannot open the file ({e.strerror or e})") from e
    try:
        size = _check_size(os.fstat(fd).st_size, expected_hash, expected_bytes)
        head = os.pread(fd, OPEN_READ_BYTES, 0)  # the header, and the token ids where they come first
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
        if len(head) < 8 + n <= size:
            head += os.pread(fd, 8 + n - len(head), len(head))
        header, md, base = _read_header(head, size)
        entries = _entries(header, base, size)
        ids_entry = entries.pop(TOKEN_IDS_KEY, None)
        token_ids = None
        raw = b""
        if ids_entry is not None and ids_entry[0] == torch.int32 and len(ids_entry[1]) == 1:
            _, _, begin, end = ids_entry
            raw = head[base + begin: base + end] if base + end <= len(head) else os.pread(fd, end - begin, base + begin)
            if len(raw) != end - begin:
                raise CorruptChunkError(expected_hash, "the file ends before its token ids do")
            token_ids = np.frombuffer(raw, dtype="<i4").tolist()
        token_ids, parent = _checked_identity(md, token_ids, expected_hash, fingerprint, verify=True, packed=raw)
        return ChunkReader(fd, expected_hash, entries, base, md, token_ids, parent, raw)
    except ValueError as e:
        os.close(fd)
        raise CorruptChunkError(expected_hash, f"not a readable safetensors file ({e})") from e
    except BaseException:
        os.close(fd)
        raise


#: Bytes :func:`open_chunk_file` reads first: a chunk's header (under 1.1 kB
#: for SmolLM2's) and its token ids, which come right after it (1 kB for 256
#: tokens; see :func:`_safetensors_bytes`), in one ``pread``. (Chunks written
#: before that layout hold a compact format's token ids after its scales: a
#: second ``pread`` then reads them.)
OPEN_READ_BYTES = 4096


_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024,
               1024)


#: Bytes per ``preadv`` while :meth:`ChunkReader.read_into` checks the checksum
#: as it reads: few enough that xxh3 finds them in the core's L2 cache (about
#: 80 GB/s a thread there, 26 from memory, on this project's VM).
HASHED_READ_BYTES = 256 << 10


def _fresh(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, Any]:
    """A new tensor of ``dtype`` and ``shape`` and a C-contiguous numpy array
    of its memory: made by numpy where numpy has the dtype (no torch
    operators, each of which gives the GIL away and waits for it back while
    the other reader holds it), else by torch (the array then of bytes)."""
    import numpy as np
    import torch

    np_dtype = _numpy_dtypes().get(dtype)
    if np_dtype is not None:
        array = np.empty(shape, dtype=np_dtype)
        return torch.from_numpy(array), array
    tensor = torch.empty(shape, dtype=dtype)
    return tensor, tensor.view(-1).view(torch.uint8).numpy()


@functools.cache
def _numpy_dtypes() -> dict[Any, Any]:
    """The dtypes :func:`_fresh` makes with numpy: numpy's, by torch dtype."""
    import numpy as np
    import torch

    return {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
            torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
            torch.uint8: np.uint8, torch.bool: np.bool_}


def _plain(bufs: Sequence[Any]) -> list[Any]:
    """``bufs`` with any stretches (:data:`~.nativeread.STRETCHES`) among them as a view per stretch."""
    return [v for b in bufs for v in (b.views() if isinstance(b, nativeread.STRETCHES) else (b,))]


def _read_hashed(fd: int, bufs: list[memoryview], offset: int, chunk: ChunkHash, h: Any) -> None:
    """Fill ``bufs`` in order from ``fd`` at ``offset`` (as :func:`_preadv_all`),
    :data:`HASHED_READ_BYTES` at a time, feeding each slice to the hasher ``h``
    right after it is read. Raises CorruptChunkError at an early end."""
    group: list[memoryview] = []
    size = 0
    for buf in bufs:
        for at in range(0, buf.nbytes, HASHED_READ_BYTES):
            piece = buf[at: at + HASHED_READ_BYTES]
            group.append(piece)
            size += piece.nbytes
            if size >= HASHED_READ_BYTES:
                _preadv_all(fd, group, offset, chunk)
                for done in group:
                    h.update(done)
                offset += size
                group, size = [], 0
    if group:
        _preadv_all(fd, group, offset, chunk)
        for done in group:
            h.update(done)


def _preadv_all(fd: int, bufs: list[memoryview], offset: int, chunk: ChunkHash) -> None:
    """Fill ``bufs`` in order from ``fd`` at ``offset``, with as few ``preadv``
    calls as the system's iovec limit allows. Raises CorruptChunkError at an early end."""
    pending = [b for b in bufs if b.nbytes]
    while pending:
        batch = pending[:_IOV_MAX]
        if hasattr(os, "preadv"):
            n = os.preadv(fd, batch, offset)
        else:  # pragma: no cover - platforms without preadv
            os.lseek(fd, offset, os.SEEK_SET)
            n = os.readv(fd, batch)
        if n <= 0:
            raise CorruptChunkError(chunk, "the file ends before its tensors do")
        offset += n
        while n and pending:
            first = pending[0]
            if n >= first.nbytes:
                n -= first.nbytes
                pending.pop(0)
            else:
                pending[0] = first[n:]
                n = 0


def meta_from_file(md: Mapping[str, str]) -> ChunkMeta:
    """Rebuild the :class:`ChunkMeta` a chunk was written with from its file metadata."""
    extra = {k[2:]: v for k, v in md.items() if k.startswith("x.")}
    return ChunkMeta(
        fingerprint=md["fingerprint"], kv_format=md["kv_format"], dtype=md["dtype"],
        block_size=int(md["block_size"]), quant=md["quant"], extra=extra,
    )
