from __future__ import annotations

import pytest
from chatkv.storage import (
    InvalidSessionIdError,
    chunk_hash,
    pack_token_ids,
    unpack_token_ids,
    validate_session_id,
)


@pytest.mark.parametrize("sid", ["a", "user-42", "A.b_c-9", "x" * 128, "a..b"])
def test_valid_ids_pass_unchanged(sid: str) -> None:
    assert validate_session_id(sid) == sid


@pytest.mark.parametrize(
    "sid, words",
    [
        ("", "empty"),
        ("x" * 129, "at most 128"),
        ("..", "start with '.'"),
        (".hidden", "start with '.'"),
        ("a/b", "'/'"),
        ("../etc/passwd", "outside"),
        ("a b", "outside"),
        ("é", "outside"),
        ("a\x00", "outside"),
        ("C:\\x", "outside"),
    ],
)
def test_invalid_ids_are_refused_with_the_rule(sid: str, words: str) -> None:
    with pytest.raises(InvalidSessionIdError, match="session id") as ei:
        validate_session_id(sid)
    assert words in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_non_str_id_refused() -> None:
    with pytest.raises(InvalidSessionIdError, match="must be a str"):
        validate_session_id(42)


def test_chunk_hash_is_chained_and_covers_every_input() -> None:
    base = chunk_hash(None, [1, 2, 3], "fp", "paged-v1")
    assert len(base) == 64 and base == chunk_hash(None, [1, 2, 3], "fp", "paged-v1")
    variants = {
        chunk_hash(None, [1, 2, 4], "fp", "paged-v1"),
        chunk_hash(None, [1, 2, 3], "fp2", "paged-v1"),
        chunk_hash(None, [1, 2, 3], "fp", "paged-v2"),
        chunk_hash(base, [1, 2, 3], "fp", "paged-v1"),
        # field boundaries are length-prefixed: moving a character between fields changes the hash
        chunk_hash(None, [1, 2, 3], "fpp", "aged-v1"),
    }
    assert base not in variants and len(variants) == 5
    with pytest.raises(ValueError):
        chunk_hash("not-a-hash", [1], "fp", "f")


def test_token_id_blob_roundtrip_and_bounds() -> None:
    ids = [0, 1, 2**31 - 1, -(2**31), 49151]
    blob = pack_token_ids(ids)
    assert len(blob) == 4 * len(ids) and blob[:8] == b"\0\0\0\0\x01\0\0\0"  # int32 little-endian
    assert unpack_token_ids(blob) == ids
    with pytest.raises(ValueError):
        pack_token_ids([2**31])
    with pytest.raises(ValueError):
        unpack_token_ids(b"\0\0\0")
