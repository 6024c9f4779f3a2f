"""Chunk hashes and the compact encoding of token ids.

A chunk's hash chains through its parent's, so equal hashes mean an equal
whole prefix, not just equal local tokens; it also covers the model
fingerprint and the KV format, so identical tokens from two models never meet.
"""

from __future__ import annotations

import hashlib
import re
import sys
from array import array
from collections.abc import Sequence
from typing import NewType

ChunkHash = NewType("ChunkHash", str)
"""Lowercase hex sha256 naming one chunk file (64 characters)."""

HASH_SCHEME = "chatkv-chunk-v1"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def chunk_hash(
    parent: str | None, token_ids: Sequence[int], fingerprint: str, kv_format: str
) -> ChunkHash:
    """Return the chained sha256 of one chunk.

    Covers the hashing scheme tag, the parent chunk's hash (``None`` for the
    first chunk of a sequence), the model fingerprint, the KV format and the
    token ids (int32 little-endian). Pure; no side effects.
    """
    return packed_chunk_hash(parent, pack_token_ids(token_ids), fingerprint, kv_format)


def packed_chunk_hash(parent: str | None, packed: bytes, fingerprint: str, kv_format: str) -> ChunkHash:
    """:func:`chunk_hash` of the token ids ``packed`` (as :func:`pack_token_ids`
    packs them: what a chunk file holds). Pure; no side effects."""
    if parent is not None and not is_chunk_hash(parent):
        raise ValueError(f"parent {parent!r} is not a chunk hash")
    h = hashlib.sha256()
    for part in (HASH_SCHEME, parent or "", fingerprint, kv_format):
        b = part.encode()
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    h.update(packed)
    return ChunkHash(h.hexdigest())


def is_chunk_hash(value: object) -> bool:
    """True if ``value`` is a 64-character lowercase hex string."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def as_chunk_hash(value: str) -> ChunkHash:
    """Return ``value`` typed as a :data:`ChunkHash`; ``ValueError`` if it is not one."""
    if not is_chunk_hash(value):
        raise ValueError(f"{value!r} is not a chunk hash (64 lowercase hex characters)")
    return ChunkHash(value)


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Encode token ids as int32 little-endian bytes (4 bytes per id).

    Raises:
        ValueError: if an id does not fit in int32.
    """
    try:
        arr = array("i", token_ids)
    except OverflowError as e:
        raise ValueError(f"token ids must fit in int32: {e}") from None
    if arr.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte int
        raise RuntimeError("array('i') is not 32-bit here")
    if sys.byteorder == "big":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    """Decode bytes made by :func:`pack_token_ids`."""
    if len(data) % 4:
        raise ValueError(f"token id blob has {len(data)} bytes, not a multiple of 4")
    arr = array("i")
    arr.frombytes(data)
    if sys.byteorder == "big":  # pragma: no cover
        arr.byteswap()
    return arr.tolist()
