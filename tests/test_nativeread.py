"""The native chunk reads (chatkv.storage.nativeread): same bytes and digest as xxhash, clear failures."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
import xxhash

from chatkv.storage import nativeread


def _as_spans(rows, pieces: list[tuple], row_bytes: int) -> list[tuple]:
    """``pieces`` of whole ``rows`` (a view of one tensor's rows) as Spans
    over that tensor's bytes, each piece's rows in two stretches."""
    import numpy as np
    import torch

    memory = rows.view(-1).view(torch.uint8).numpy()
    base = memory.ctypes.data
    out = []
    for view, offset, convert, first in pieces:
        n = view.nbytes // row_bytes
        start = view.ctypes.data - base
        cut = (n // 2) * row_bytes
        out.append((nativeread.Spans(memory, np.array([start, start + cut], dtype=np.int64),
                                     np.array([cut, n * row_bytes - cut], dtype=np.int64)), offset, convert, first))
    return out


@pytest.fixture(scope="module")
def reads(native_reads) -> nativeread.NativeReads:
    """conftest's ``native_reads`` (which fails where CI needs them), by the name these tests use."""
    return native_reads


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


def test_pieces_read_first_and_hashed_later_count_once_in_their_turn(reads: nativeread.NativeReads,
                                                                    tmp_path: Path) -> None:
    """A (buffer, offset, None) piece is filled and left out of the digest; a
    later piece that only hashes that buffer puts its bytes in, in its turn
    (a conversion's scales: read before the codes, hashed after them). An
    offset or a Spans such a piece cannot use is refused before anything is read."""
    import numpy as np

    data = os.urandom(50_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    early, rest = bytearray(12_345), bytearray(20_000)
    with open(path, "rb") as f:
        digest = reads.read_hashed(f.fileno(), [(early, 30_000, None), (rest, 0), (early, -1), (b"end", -1)], 4096)
        assert bytes(early) == data[30_000:42_345] and bytes(rest) == data[:20_000]
        assert digest == xxhash.xxh3_128(data[:20_000] + data[30_000:42_345] + b"end").hexdigest()
        untouched = bytearray(10)
        spans = nativeread.Spans(untouched, np.array([0], dtype=np.int64), np.array([10], dtype=np.int64))
        for bad in ((bytearray(8), -1, None), (spans, 0, None)):
            with pytest.raises(ValueError, match="read and not hashed"):
                reads.read_hashed(f.fileno(), [(untouched, 0), bad], 4096)
        assert untouched == bytearray(10)
        with pytest.raises(EOFError):
            reads.read_hashed(f.fileno(), [(bytearray(10), 49_995, None)], 4096)


@pytest.mark.parametrize("slice_bytes", [1, 700, 4096, 1 << 20])
def test_spans_are_filled_stretch_by_stretch_from_one_run_of_the_file(reads: nativeread.NativeReads,
                                                                      tmp_path: Path, slice_bytes: int) -> None:
    """A Spans piece takes the file's bytes from its offset on, in order,
    into its stretches (out of buffer order, an empty one among them, some
    larger and some smaller than a slice), and hashes them in that order."""
    import numpy as np

    data = os.urandom(10_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    memory = bytearray(12_000)
    offsets = np.array([9_000, 0, 5_000, 3_000, 6_500], dtype=np.int64)
    sizes = np.array([2_500, 2_500, 0, 1_500, 2_000], dtype=np.int64)
    spans = nativeread.Spans(memory, offsets, sizes)
    with open(path, "rb") as f:
        digest = reads.read_hashed(f.fileno(), [(b"head", -1), (spans, 1_000), (b"tail", -1)], slice_bytes)
    want = bytearray(12_000)
    at = 1_000
    for o, n in zip(offsets.tolist(), sizes.tolist()):
        want[o: o + n] = data[at: at + n]
        at += n
    assert memory == want and at == 9_500
    assert digest == xxhash.xxh3_128(b"head" + data[1_000:9_500] + b"tail").hexdigest()


def _planes_spans(planes: nativeread.Planes, lo: int, hi: int, first: int, every: int) -> nativeread.Spans:
    """What ``planes.span(lo, hi, first, every)`` fills, as a Spans over the same memory."""
    import numpy as np

    offsets, sizes = [], []
    for start in planes.starts[first::every]:
        at = 0
        for a, b in planes.runs:
            x, y = max(lo, at), min(hi, at + b - a)
            if x < y:
                offsets.append(start + a + x - at)
                sizes.append(y - x)
            at += b - a
    return nativeread.Spans(planes.memory, np.array(offsets, dtype=np.int64), np.array(sizes, dtype=np.int64))


@pytest.mark.parametrize("slice_bytes", [7, 4096])
def test_plane_spans_fill_what_spans_of_their_stretches_fill(reads: nativeread.NativeReads, tmp_path: Path,
                                                             slice_bytes: int) -> None:
    """A PlaneSpans (bytes lo .. hi of runs out of order, in planes first,
    first + every, ...) fills the bytes a Spans of those stretches fills,
    plainly and converted (int8 rows scaled into float32), with the same
    digest; its views are those stretches (for reads in Python)."""
    import numpy as np

    row = 8  # int8 codes a row; 32 bytes once converted to float32
    data = os.urandom(4_000)
    scale = np.frombuffer(os.urandom(4 * 40), dtype=np.uint8).view(np.float32).copy()
    scale[~np.isfinite(scale)] = 0.5
    path = tmp_path / "f"
    path.write_bytes(data)
    runs = [(96, 160), (0, 64), (224, 320)]  # 224 bytes of each plane, whole rows of 32
    got, want = bytearray(1_600), bytearray(1_600)
    got_planes = nativeread.Planes(got, [0, 400, 800, 1_200], runs)
    want_planes = nativeread.Planes(want, [0, 400, 800, 1_200], runs)
    assert got_planes.total == 224
    for lo, hi, first, every in ((0, 224, 0, 1), (32, 192, 1, 2), (40, 41, 0, 2), (64, 64, 0, 1)):
        plane_spans = got_planes.span(lo, hi, first, every)
        spans = _planes_spans(want_planes, lo, hi, first, every)
        assert plane_spans.nbytes == spans.nbytes
        assert [bytes(v) for v in plane_spans.views()] == [bytes(v) for v in spans.views()]
        with open(path, "rb") as f:
            a = reads.read_hashed(f.fileno(), [(b"h", -1), (plane_spans, 100)], slice_bytes)
            b = reads.read_hashed(f.fileno(), [(b"h", -1), (spans, 100)], slice_bytes)
            assert got == want and a == b
            if lo % 32 == 0 and hi % 32 == 0:  # whole float32 rows: converted too
                convert = nativeread.Convert("int8", "float32", row, scale)
                a = reads.read_hashed(f.fileno(), [(plane_spans, 500, convert, 3)], slice_bytes)
                b = reads.read_hashed(f.fileno(), [(spans, 500, convert, 3)], slice_bytes)
                assert got == want and a == b
    assert got != bytearray(1_600)


def test_planes_outside_their_memory_and_partial_rows_are_refused_before_reading(reads: nativeread.NativeReads,
                                                                                 tmp_path: Path) -> None:
    """Planes whose runs leave their memory, reversed runs, read-only memory
    and a span outside the runs are refused when made; a converted span of
    partial rows when read, before any byte lands."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1_000))
    memory = bytearray(400)
    for starts, runs in (([0, 300], [(0, 101)]), ([-1], [(0, 10)]), ([0], [(10, 5)]), ([0], [(-5, 5)])):
        with pytest.raises(ValueError):
            nativeread.Planes(memory, starts, runs)
    with pytest.raises(TypeError, match="read-only"):
        nativeread.Planes(bytes(400), [0], [(0, 10)])
    planes = nativeread.Planes(memory, [0, 200], [(0, 96)])
    for lo, hi, first, every in ((0, 97, 0, 1), (-1, 10, 0, 1), (20, 10, 0, 1), (0, 10, 2, 2)):
        with pytest.raises(ValueError):
            planes.span(lo, hi, first, every)
    convert = nativeread.Convert("int8", "float32", 8, bytearray(4 * 10))
    with open(path, "rb") as f:
        with pytest.raises(ValueError, match="whole rows"):
            reads.read_hashed(f.fileno(), [(bytearray(3), 0), (planes.span(16, 80), 0, convert, 0)], 4096)
        with pytest.raises(ValueError, match="spans are read into"):
            reads.read_hashed(f.fileno(), [(planes.span(0, 32), -1)], 4096)
    assert memory == bytearray(400)


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


@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp16", "bf16", "none"])
@pytest.mark.parametrize("target", ["float32", "bfloat16"])
@pytest.mark.parametrize("slice_bytes", [100, 4096, 1 << 20])
@pytest.mark.parametrize("head_dim", [64, 128, 48])  # the two rows the C code unrolls, and any other
@pytest.mark.parametrize("spans", [False, True])
def test_converted_pieces_match_torchs_dequantization_bit_for_bit(reads: nativeread.NativeReads, tmp_path: Path,
                                                                  scheme: str, target: str, slice_bytes: int,
                                                                  head_dim: int, spans: bool) -> None:
    """Codes read from a file and converted as they land (split over two
    destination pieces, the second at an odd row; or as two Spans of two
    stretches each) hold exactly what chatkv.quant's dequantization writes
    into a tensor of the target dtype, and the digest is that of the codes'
    bytes."""
    import torch

    from chatkv.quant import dequantize_rows_into, quantize

    torch.manual_seed(0)
    x = torch.randn(3, 16, 2, head_dim) * torch.logspace(-3, 2, head_dim)  # rows of very different magnitudes
    q = quantize(x, "k", scheme) if scheme != "none" else None
    codes = x.to(torch.float32) if q is None else q.data
    out_dtype = getattr(torch, target)
    want = torch.empty(x.shape, dtype=out_dtype)
    if q is None:
        want.copy_(codes)
    else:
        dequantize_rows_into(scheme, q.data, q.scale, want)
    raw = codes.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    path = tmp_path / "codes"
    path.write_bytes(b"pad!" + raw)
    got = torch.full(x.shape, 7.0, dtype=out_dtype)
    rows = got.view(-1, head_dim)
    cut = 37
    source = str(codes.dtype).removeprefix("torch.")
    scale = None if q is None or q.scale is None else q.scale.contiguous().view(-1)
    convert = nativeread.Convert(source, target, head_dim, None if scale is None else scale.numpy())
    pieces = [(rows[lo:hi].view(torch.uint8).numpy(), 4 + lo * head_dim * codes.element_size(), convert, lo)
              for lo, hi in ((0, cut), (cut, rows.shape[0]))]
    if spans:
        pieces = _as_spans(rows, pieces, head_dim * got.element_size())
    with open(path, "rb") as f:
        digest = reads.read_hashed(f.fileno(), pieces, slice_bytes)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert digest == xxhash.xxh3_128(raw).hexdigest()


def test_a_conversion_that_does_not_fit_its_piece_is_refused_before_reading(reads: nativeread.NativeReads,
                                                                            tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(100)))
    target = bytearray(b"\xee" * 40)  # 10 float32
    cases = {
        "no conversion": (nativeread.Convert("int4", "float32", 5), 0),
        "not whole rows": (nativeread.Convert("int8", "float32", 3), 0),
        "8 bytes of scales where rows 0 to 5 need 20": (nativeread.Convert("int8", "float32", 2, bytearray(8)), 0),
        "rows 1 to 6 need 24": (nativeread.Convert("int8", "float32", 2, bytearray(20)), 1),
        "no offsets": (nativeread.Convert("int8", "float32", 2, zero=bytearray(20)), 0),
        "either a block or whole groups": (nativeread.Convert("uint4x2", "float32", 2, bytearray(8), bytearray(8)), 0),
        "not whole bytes": (nativeread.Convert("uint4x2", "float32", 1, bytearray(8), bytearray(8), group=1), 0),
    }
    with open(path, "rb") as f:
        for match, (convert, first) in cases.items():
            with pytest.raises(ValueError, match=match):
                reads.read_hashed(f.fileno(), [(target, 0, convert, first)], 4096)
            assert target == bytearray(b"\xee" * 40)
        with pytest.raises(EOFError):  # 10 int8 codes wanted at 95: the file ends first
            reads.read_hashed(f.fileno(), [(target, 95, nativeread.Convert("int8", "float32", 5), 0)], 4096)


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("target", ["float32", "bfloat16"])
@pytest.mark.parametrize("slice_bytes", [50, 4096, 1 << 20])
@pytest.mark.parametrize("spans", [False, True])
def test_int4_codes_convert_as_chatkv_quant_dequantizes_them(reads: nativeread.NativeReads, tmp_path: Path,
                                                             kind: str, target: str, slice_bytes: int,
                                                             spans: bool) -> None:
    """int4 keys (a scale and offset per channel over a block of tokens) and
    values (per group of channels of each token), read and converted in two
    pieces cut mid-block (or as two Spans of two stretches each): bit for
    bit chatkv.quant's float32 dequantization, rounded once to the target."""
    import torch

    from chatkv.quant import dequantize_int4_blocks_into, quantize

    torch.manual_seed(1)
    n, bs, h, d = 3, 16, 2, 64
    x = torch.randn(n, bs, h, d) * torch.logspace(-2, 1, d)
    q = quantize(x, kind, "int4")
    wide = torch.empty(n, bs, h, d)
    dequantize_int4_blocks_into(q, 0, n, wide)
    want = wide.to(getattr(torch, target))
    raw = q.data.contiguous().view(-1).numpy().tobytes()
    path = tmp_path / "codes"
    path.write_bytes(b"xyz" + raw)
    got = torch.full(x.shape, 3.0, dtype=getattr(torch, target))
    rows, row, cut = got.view(-1, h * d), h * d, 21  # row 21: five rows into the second block
    scale, zero = q.scale.contiguous().view(-1).numpy(), q.zero.contiguous().view(-1).numpy()
    layout = {"block": bs} if kind == "k" else {"group": q.group_size}
    convert = nativeread.Convert("uint4x2", target, row, scale, zero, **layout)
    pieces = [(rows[lo:hi].view(torch.uint8).numpy(), 3 + lo * row // 2, convert, lo)
              for lo, hi in ((0, cut), (cut, n * bs))]
    if spans:
        pieces = _as_spans(rows, pieces, row * got.element_size())
    with open(path, "rb") as f:
        digest = reads.read_hashed(f.fileno(), pieces, slice_bytes)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert digest == xxhash.xxh3_128(raw).hexdigest()
    short = nativeread.Convert("uint4x2", target, row, scale[: len(scale) // 3], zero, **layout)
    pieces = [(rows[: bs + 1].view(torch.uint8).numpy(), 3, short, 0)]
    if spans:
        pieces = _as_spans(rows, pieces, row * got.element_size())
    with open(path, "rb") as f, pytest.raises(ValueError, match="bytes of scales where"):
        reads.read_hashed(f.fileno(), pieces, slice_bytes)


def test_a_new_build_falls_back_without_per_cpu_code_and_removes_stale_libraries(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """A compiler that refuses the per-CPU builds of the conversions still
    gets a working library (built without them); building it removes the
    cache's libraries unused for a month, not a recent one, and finding a
    library in the cache marks it used."""
    compiler = nativeread._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    picky = tmp_path / "picky-cc"
    picky.write_text("#!/bin/sh\ncase \"$*\" in *-DCHATKV_NO_CLONES*) exec " + " ".join(compiler)
                     + " \"$@\";; esac\necho 'no target_clones here' >&2\nexit 1\n")
    picky.chmod(0o755)
    cache = tmp_path / "cache"
    cache.mkdir()
    stale, recent = cache / "readhash-0000000000000000.so", cache / "readhash-1111111111111111.so"
    for path in (stale, recent):
        path.write_bytes(b"an older build")
    month = nativeread.STALE_LIBRARY_SECONDS + 60
    os.utime(stale, (os.path.getmtime(stale) - month,) * 2)
    monkeypatch.setattr(nativeread, "_cache_dir", lambda: cache)
    library = nativeread._build([str(picky)])
    assert library.is_file() and not stale.exists() and recent.exists()
    import xxhash._xxhash as extension

    reads = nativeread.NativeReads(library, extension.__file__)
    assert nativeread._self_test(reads) is None
    os.utime(library, (1, 1))
    assert nativeread._build([str(picky)]) == library and os.path.getmtime(library) > 1


def test_fast_conversions_give_the_portable_codes_bits(reads: nativeread.NativeReads, tmp_path: Path,
                                                       monkeypatch) -> None:
    """Every conversion into bfloat16 gives, bit for bit, what the same
    library built without per-CPU code gives (plain C, one element at a
    time): on a CPU with AVX-512 BF16 the code that rounds 32 at a time with
    its instruction, whose NaNs and float32 subnormals differ from
    chatkv's and are converted one by one instead. So does every one of
    int8, fp8, float16 and bfloat16 codes into float32 (on a CPU with
    AVX-512, 32 at a time), but that a NaN times a NaN scale may come out
    with either one's payload. And so does the library built to take the
    AVX2 code wherever it can (``CHATKV_AVX2_ONLY``: what a CPU without
    AVX-512 runs, 16 at a time, rounding to bfloat16 with integer
    operations), on a CPU with AVX2. Random bit patterns of
    every source type (NaNs, infinities and subnormals among them), scales
    that make products subnormal, infinite or NaN, rows of 32 and more with
    a rest, and int4 codes per block and per group (more than 16 groups a
    row among them), into either type; into memory that starts
    a cache line (where the fast code's stores are non-temporal) and memory
    that starts two bytes past one."""
    import numpy as np

    compiler = nativeread._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(nativeread, "_cache_dir", lambda: tmp_path)
    import xxhash._xxhash as extension

    def built_with(define: str) -> nativeread.NativeReads:
        """The library built by the compiler with ``-D<define>`` added."""
        cc = tmp_path / f"{define.lower()}-cc"
        cc.write_text("#!/bin/sh\nexec " + " ".join(compiler) + f" -D{define} \"$@\"\n")
        cc.chmod(0o755)
        return nativeread.NativeReads(nativeread._build([str(cc)]), extension.__file__)

    portable = built_with("CHATKV_NO_CLONES")
    avx2 = built_with("CHATKV_AVX2_ONLY")
    rng = np.random.default_rng(3)

    def both(data: np.ndarray, convert: nativeread.Convert, elements: int) -> None:
        path = tmp_path / "codes"
        path.write_bytes(data.tobytes())
        outs = []
        bits = np.uint16 if convert.target == "bfloat16" else np.uint32
        for library, shift in ((portable, 0), (reads, 0), (reads, 1), (avx2, 0), (avx2, 1)):
            memory = np.zeros(elements + 64, dtype=bits)
            size = memory.itemsize
            start = (-memory.ctypes.data % 64) // size + shift  # elements to the line's start, and shift past it
            out = memory[start: start + elements]
            with open(path, "rb") as f:
                digest = library.read_hashed(f.fileno(), [(out, 0, convert, 0)], 1 << 14)
            outs.append((out, digest))
        (plain, plain_digest), *fast_ones = outs
        for fast, fast_digest in fast_ones:
            assert fast_digest == plain_digest
            same = fast == plain
            if bits is np.uint32:  # (a product of two NaNs is a NaN, either one's payload)
                same |= np.isnan(fast.view(np.float32)) & np.isnan(plain.view(np.float32))
            differ = np.nonzero(~same)[0]
            assert differ.size == 0, (convert.source, convert.row, differ[:4], fast[differ[:4]], plain[differ[:4]])

    sizes = {"int8": 1, "float8_e4m3fn": 1, "float16": 2, "bfloat16": 2, "float32": 4}
    for source, size in sizes.items():
        for row in (32, 64, 96, 37):
            rows = 129
            data = rng.integers(0, 256, rows * row * size, dtype=np.uint8)
            if source == "float32":  # mostly numbers, as a float32 tail holds
                numbers = rng.standard_normal(rows * row).astype(np.float32).view(np.uint8)
                keep = rng.random(numbers.size) < 0.8
                data[keep] = numbers[keep]
            scales = rng.random(rows).astype(np.float32) * 0.05
            # Tame scales (each times 2^120 finite: e4m3's one-multiply path in one flat loop
            # where rows are whole 32s), then wild ones (not finite, or not once times 2^120).
            tame = scales.copy()
            tame[::7], tame[::11] = 1e-40, 0
            scales[::7], scales[::11], scales[::13], scales[::17], scales[::19] = 1e-40, 0, np.inf, np.nan, 3e38
            for scaled in (tame, scales, None) if source in ("int8", "float8_e4m3fn") else (None,):
                for target in ("bfloat16", "float32") if source != "float32" else ("bfloat16",):
                    both(data, nativeread.Convert(source, target, row, scaled), rows * row)
    for row, options in ((192, {"block": 16}), (64, {"block": 16}), (192, {"group": 32}), (192, {"group": 64}),
                         (64, {"group": 16}), (40, {"group": 8}), (1024, {"group": 32}),
                         (40, {"block": 8})):
        rows = 64
        count = rows // options["block"] * row if "block" in options else rows * row // options["group"]
        scale = rng.standard_normal(count).astype(np.float16)
        zero = rng.standard_normal(count).astype(np.float16)
        scale.view(np.uint16)[::9] = rng.integers(0, 1 << 16, scale[::9].size, dtype=np.uint16)  # any bits
        zero.view(np.uint16)[::10] = rng.integers(0, 1 << 16, zero[::10].size, dtype=np.uint16)
        data = rng.integers(0, 256, rows * row // 2, dtype=np.uint8)
        for target in ("bfloat16", "float32"):
            both(data, nativeread.Convert("uint4x2", target, row, scale, zero, **options), rows * row)
