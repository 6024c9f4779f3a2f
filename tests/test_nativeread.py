"""The native chunk reads (chatkv.storage.nativeread): same bytes and digest as xxhash, clear failures."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
import xxhash

from chatkv.storage import nativeread


@pytest.fixture(scope="module")
def reads() -> nativeread.NativeReads:
    got = nativeread.wait_prepared(120)
    if got is None:
        pytest.skip(f"native chunk reads unavailable here: {nativeread.unavailable_reason()}")
    return got


@pytest.mark.parametrize("slice_bytes", [1, 4096, 1 << 20])
def test_pieces_land_and_hash_as_xxhash_does(reads: nativeread.NativeReads, tmp_path: Path, slice_bytes: int) -> None:
    """Pieces read from a file at their offsets (out of file order, one empty)
    and pieces only hashed (bytes, a read-only view, a writable one) give the
    file's bytes where asked and the digest of everything in order."""
    data = os.urandom(70_001)
    path = tmp_path / "f"
    path.write_bytes(data)
    a, b, empty = bytearray(30_000), bytearray(40_001), bytearray(0)
    readonly = memoryview(b"read-only")
    writable = bytearray(b"writable")
    with open(path, "rb") as f:
        digest = reads.read_hashed(f.fileno(), [(b"head", -1), (b, 30_000), (empty, 5), (readonly, -1),
                                                (memoryview(a), 0), (writable, -1)], slice_bytes)
    assert bytes(a) == data[:30_000] and bytes(b) == data[30_000:]
    assert digest == xxhash.xxh3_128(b"head" + data[30_000:] + b"read-only" + data[:30_000] + b"writable").hexdigest()


def test_an_early_end_a_failed_read_and_a_read_only_target_are_errors(reads: nativeread.NativeReads,
                                                                      tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    with open(path, "rb") as f:
        with pytest.raises(EOFError):
            reads.read_hashed(f.fileno(), [(bytearray(60), 50)], 4096)
        for target in (b"y" * 10, memoryview(b"y" * 10)):
            with pytest.raises(TypeError, match="read-only"):
                reads.read_hashed(f.fileno(), [(target, 0)], 4096)
            assert bytes(target) == b"y" * 10
    fd = os.open(path, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(OSError) as ei:
        reads.read_hashed(fd, [(bytearray(10), 0)], 4096)
    assert ei.value.errno == errno.EBADF


def test_the_environment_switch_and_a_failing_compiler_keep_reads_in_python(monkeypatch) -> None:
    monkeypatch.setenv(nativeread.NATIVE_ENV, "0")
    assert nativeread._prepare() == (None, f"${nativeread.NATIVE_ENV} is '0'")
    monkeypatch.delenv(nativeread.NATIVE_ENV)
    failing = [sys.executable, "-c", "import sys; sys.exit('no such compiler')"]
    monkeypatch.setattr(nativeread, "_compiler", lambda: failing)
    reads, why = nativeread._prepare()
    assert reads is None and "compiling the native reads failed" in why and "no such compiler" in why
