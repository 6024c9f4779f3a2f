"""A chunk's bytes read and checksummed in one native call, without the GIL.

:meth:`~.chunkfile.ChunkReader.read_into` reads a chunk a slice at a time
(:data:`~.chunkfile.HASHED_READ_BYTES`) and feeds each slice to xxh3 while it
is still in the core's cache. In Python each slice is a ``preadv`` call and
an ``update`` call, and between the two the reading thread needs the GIL
back, which a restore's two reader threads (and the caller, templating the
turn) hand back and forth.

This module builds, once per machine, a C function of a few lines that runs
the same loop over a whole chunk (``pread`` a slice, feed it to the hash,
next), and calls it through :mod:`ctypes`, which releases the GIL for the
call. The hash is xxhash's own: the functions the ``xxhash`` package's
extension module exports (its dispatching build, which picks AVX2 or AVX-512
code for the CPU), so the digest is the one the Python path computes; that is
checked on a probe file, bytes and digest, before the function is used.
With the reader threads on CPUs of their own (:mod:`chatkv.persistence`),
one engine restored a 1,494-token bfloat16 session from the page cache in
6.49 ms this way against 7.36 through Python (20 restores each, alternating;
this project's 2-CPU AMD VM).

The build runs in a background thread (:func:`prepare_in_background`: a
Store starts it when it opens), with the C compiler (``$CC``, else ``cc``)
into the user's cache directory (``readhash-<tag>.so``, the tag a hash of the
source and the compiler); later processes load that file. A read never waits
for it: until it is ready (or where it cannot be: no compiler, no exported
xxhash functions, ``CHATKV_NATIVE_READ=0``), :func:`reader` returns None and
chunks are read in Python, as before; the log says once why.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: ``0`` keeps chunk reads in Python (:func:`reader` returns None).
NATIVE_ENV = "CHATKV_NATIVE_READ"

#: What :func:`chatkv_read_hashed` returns when the file ends before the pieces do.
_SHORT_READ = -(1 << 40)

_SOURCE = r"""
#include <errno.h>
#include <stddef.h>
#include <sys/types.h>
#include <unistd.h>

typedef int (*chatkv_update_fn)(void *state, const void *input, size_t length);

/* For each of the n pieces in order: where off[i] < 0, feed the len[i] bytes
   at addr[i] to the hash; else fill them from fd at offset off[i], at most
   slice bytes per pread, feeding each slice to the hash as soon as it lands.
   Returns the bytes read from fd, -errno after a failed read, or
   -(1 << 40) when the file ends before the pieces do. */
long long chatkv_read_hashed(int fd, long long n, const long long *addr, const long long *len,
                             const long long *off, long long slice, void *state, chatkv_update_fn update)
{
    long long total = 0;
    for (long long i = 0; i < n; i++) {
        char *p = (char *)(size_t)addr[i];
        long long left = len[i], at = off[i];
        if (at < 0) {
            update(state, p, (size_t)left);
            continue;
        }
        while (left > 0) {
            size_t want = left < slice ? (size_t)left : (size_t)slice;
            ssize_t got = pread(fd, p, want, (off_t)at);
            if (got < 0) {
                if (errno == EINTR)
                    continue;
                return -(long long)errno;
            }
            if (got == 0)
                return -(1LL << 40);
            update(state, p, (size_t)got);
            p += got;
            at += got;
            left -= got;
            total += got;
        }
    }
    return total;
}
"""


class _Hash128(ctypes.Structure):
    """xxhash's ``XXH128_hash_t``."""

    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


class NativeReads:
    """The loaded function and xxhash's xxh3-128 entry points (see the module doc)."""

    def __init__(self, library: Path, xxhash_library: str) -> None:
        """Load the built ``library`` and xxhash's extension module at ``xxhash_library``.

        Raises:
            OSError: a library does not load.
            AttributeError: a function is missing (xxhash's dispatching update among them).
        """
        lib = ctypes.CDLL(str(library))
        xx = ctypes.CDLL(xxhash_library)
        ll = ctypes.c_longlong
        self._read = lib.chatkv_read_hashed
        self._read.restype = ll
        self._read.argtypes = [ctypes.c_int, ll, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ll,
                               ctypes.c_void_p, ctypes.c_void_p]
        self._create = xx.XXH3_createState
        self._create.restype = ctypes.c_void_p
        self._create.argtypes = []
        self._reset = xx.XXH3_128bits_reset
        self._reset.argtypes = [ctypes.c_void_p]
        self._digest = xx.XXH3_128bits_digest
        self._digest.argtypes = [ctypes.c_void_p]
        self._digest.restype = _Hash128
        self._free = xx.XXH3_freeState
        self._free.argtypes = [ctypes.c_void_p]
        # The dispatching update (AVX2/AVX-512 where the CPU has them), as xxhash's
        # Python objects use: the plain symbol is its SSE2 build, slower than them.
        self._update = ctypes.cast(xx.XXH3_128bits_update_dispatch, ctypes.c_void_p).value
        self._libraries = (lib, xx)  # kept loaded

    def read_hashed(self, fd: int, pieces: Sequence[tuple[Any, int]], slice_bytes: int) -> str:
        """Fill and hash ``pieces`` in order, in one call that releases the GIL:
        each ``(buffer, offset)`` with ``offset >= 0`` is filled from ``fd`` at
        that offset (a writable buffer, C-contiguous), ``slice_bytes`` per
        ``pread``, each slice hashed as it lands; one with ``offset < 0`` (any
        buffer, ``bytes`` included) is only hashed. Returns xxh3-128's hex
        digest of all of it, as ``xxhash.xxh3_128().hexdigest()`` gives.

        Raises:
            EOFError: the file ends before the pieces do (what landed is unverified).
            OSError: a read failed.
            TypeError: a piece to be filled is read-only (nothing was read).
            ValueError: a piece is not C-contiguous (nothing was read).
        """
        addresses: list[int] = []
        lengths: list[int] = []
        offsets: list[int] = []
        pinned: list[Any] = []  # the buffers' exports, alive until the call returns
        for buf, offset in pieces:
            address, size = self._address(buf, pinned, filled=offset >= 0)
            if size:
                addresses.append(address)
                lengths.append(size)
                offsets.append(offset)
        n = len(addresses)
        arrays = [(ctypes.c_longlong * n)(*values) for values in (addresses, lengths, offsets)]
        state = self._create()
        if not state:
            raise MemoryError("XXH3_createState failed")
        try:
            self._reset(state)
            got = self._read(fd, n, *arrays, slice_bytes, state, self._update)
            if got == _SHORT_READ:
                raise EOFError("the file ends before the pieces do")
            if got < 0:
                raise OSError(-got, os.strerror(-got))
            digest = self._digest(state)
        finally:
            self._free(state)
        return f"{digest.high64:016x}{digest.low64:016x}"

    @staticmethod
    def _address(buf: Any, pinned: list[Any], filled: bool) -> tuple[int, int]:
        """``(address, bytes)`` of ``buf``'s memory, its export kept in ``pinned``.

        Raises:
            TypeError: ``buf`` is to be ``filled`` but read-only.
            ValueError: ``buf`` is not C-contiguous.
        """
        view = memoryview(buf)
        if filled and view.readonly:
            raise TypeError("a piece to be read into is read-only")
        if not view.c_contiguous:
            raise ValueError("a piece is not C-contiguous")
        size = view.nbytes
        if not size:
            return 0, 0
        if view.readonly:  # only hashed: its bytes, kept alive, are as good
            data = buf if isinstance(buf, bytes) else view.tobytes()
            pinned.append(data)
            return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0, size
        export = ctypes.c_char.from_buffer(view.cast("B"))
        pinned.append(export)
        return ctypes.addressof(export), size


_lock = threading.Lock()
_state: dict[str, Any] = {"reads": None, "started": False, "done": threading.Event(), "why": None}


def reader() -> NativeReads | None:
    """The native reads where they are ready; None otherwise (never waits).
    The first call starts :func:`prepare_in_background` where no one has."""
    reads = _state["reads"]
    if reads is None and not _state["started"]:
        prepare_in_background()
    return reads


def prepare_in_background() -> None:
    """Build or load the native reads in a daemon thread, once per process
    (later calls do nothing); failures are logged, and reads stay in Python."""
    with _lock:
        if _state["started"]:
            return
        _state["started"] = True
    threading.Thread(target=_prepare_logged, name="chatkv-native-read", daemon=True).start()


def wait_prepared(timeout: float | None = None) -> NativeReads | None:
    """Start the preparation if needed and wait for it (at most ``timeout``
    seconds); the native reads, or None where they are off or not ready."""
    prepare_in_background()
    _state["done"].wait(timeout)
    return _state["reads"]


def unavailable_reason() -> str | None:
    """Why the native reads are off once preparing them ended without them, else None."""
    return _state["why"]


def _prepare_logged() -> None:
    try:
        reads, why = _prepare()
    except Exception as exc:  # noqa: BLE001 - reads stay in Python; say why
        reads, why = None, f"{type(exc).__name__}: {exc}"
        log.warning("native chunk reads are off (reads stay in Python): %s", why, exc_info=True)
    else:
        if reads is None:
            log.info("native chunk reads are off (reads stay in Python): %s", why)
        else:
            log.debug("native chunk reads are on")
    _state["reads"], _state["why"] = reads, why
    _state["done"].set()


def _prepare() -> tuple[NativeReads | None, str | None]:
    """``(the reads, None)``, or ``(None, why not)``."""
    if os.environ.get(NATIVE_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None, f"${NATIVE_ENV} is {os.environ[NATIVE_ENV]!r}"
    if not hasattr(os, "pread"):
        return None, "no pread on this platform"
    try:
        import xxhash._xxhash as extension
    except ImportError as exc:
        return None, f"xxhash's extension module does not import ({exc})"
    xxhash_library = getattr(extension, "__file__", None)
    if not xxhash_library:
        return None, "xxhash's extension module has no file"
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler ($CC, cc, gcc or clang)"
    try:
        library = _build(compiler)
    except OSError as exc:
        log.warning("could not build the native chunk reads with %s: %s", compiler[0], exc)
        return None, str(exc)
    try:
        reads = NativeReads(library, xxhash_library)
    except (OSError, AttributeError) as exc:
        return None, f"cannot load the reads or xxhash's functions ({exc})"
    mismatch = _self_test(reads)
    if mismatch:
        log.warning("native chunk reads disagree with the Python path (%s); reads stay in Python", mismatch)
        return None, mismatch
    return reads, None


def _compiler() -> list[str] | None:
    """The C compiler's command words: ``$CC``, else Python's build compiler, ``cc``, ``gcc`` or ``clang``."""
    for spec in (os.environ.get("CC"), sysconfig.get_config_var("CC")):
        words = (spec or "").split()
        if words and shutil.which(words[0]):
            return words
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def _cache_dir() -> Path:
    """Where built libraries are kept: the user's cache directory, else a temporary one."""
    import platformdirs

    preferred = Path(platformdirs.user_cache_dir("chatkv", appauthor=False)) / "native"
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        if os.access(preferred, os.W_OK):
            return preferred
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="chatkv-native-"))


def _build(compiler: list[str]) -> Path:
    """The built library: found in the cache, else compiled into it (atomically).

    Raises:
        OSError: compiling failed (its message included).
    """
    tag = hashlib.sha256("\0".join([_SOURCE, *compiler, platform.machine()]).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    library = out_dir / f"readhash-{tag}.so"
    if library.is_file():
        return library
    with tempfile.TemporaryDirectory(prefix="build-", dir=out_dir) as tmp:
        source = Path(tmp) / "readhash.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / library.name
        done = subprocess.run([*compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(source)],
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0 or not built.is_file():
            raise OSError(errno.ENOEXEC, f"compiling the native reads failed: {(done.stderr or done.stdout)[-500:]}")
        os.replace(built, library)  # another process may have put the same file there: same bytes
    return library


def _self_test(reads: NativeReads) -> str | None:
    """Read and hash a probe file both ways; None when bytes and digests agree, else what differs."""
    import xxhash

    payload = os.urandom(300_007)
    header = b"probe\0uint8\0(300007,)\n"
    cuts = (0, 1, 65_536, 200_000, 300_007)
    with tempfile.TemporaryFile() as f:
        f.write(b"x" * 13 + payload)
        f.flush()
        targets = [bytearray(b - a) for a, b in zip(cuts, cuts[1:])]
        pieces: list[tuple[Any, int]] = [(header, -1)]
        pieces += [(t, 13 + a) for t, a in zip(targets, cuts)]
        pieces.append((b"tail", -1))
        digest = reads.read_hashed(f.fileno(), pieces, 100_000)
        try:
            reads.read_hashed(f.fileno(), [(bytearray(10), 13 + 300_000)], 100_000)
            return "a read past the end of the probe file was not reported"
        except EOFError:
            pass
    if b"".join(targets) != payload:
        return "the probe file's bytes read differently"
    expected = xxhash.xxh3_128(header + payload + b"tail").hexdigest()
    if digest != expected:
        return f"digest {digest} where xxhash gives {expected}"
    return None
