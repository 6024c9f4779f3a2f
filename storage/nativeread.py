"""A chunk's bytes read and checksummed in one native call, without the GIL.

:meth:`~.chunkfile.ChunkReader.read_into` reads a chunk a slice at a time
(:data:`~.chunkfile.HASHED_READ_BYTES`) and feeds each slice to xxh3 while it
is still in the core's cache. In Python each slice is a ``preadv`` call and
an ``update`` call, and between the two the reading thread needs the GIL
back, which a restore's two reader threads (and the caller, templating the
turn) hand back and forth.

This module builds, once per machine, a small C library whose function runs
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

The same call converts a compact chunk's codes as they land
(:class:`Convert`): each slice of whole rows is read into memory of the
call's own (in the core's cache), hashed there, and written where it goes,
each row times its float32 scale (int4: code times scale plus offset),
computed in float32 and rounded once to float32 or bfloat16: what
:mod:`chatkv.quant` computes for int8, fp8, int4 and the float16/bfloat16
casts, bit for bit (the tests compare them; before use, the library is
checked on probe rows of every type against the same arithmetic done
here in Python). A compact
chunk is then one pass from the page cache into the pool, in the reader
threads, instead of a read into memory and a dequantization by the engine's
loop. The conversions are built for AVX-512, AVX2 and any x86-64 where the
compiler is GCC 12 or later (``target_clones``); elsewhere, or where the
compiler refuses them, once, plainly. Those into bfloat16 are built once
more for CPUs with AVX-512 BF16 (chosen at run time): 32 elements scaled
and rounded to nearest even by its instruction at a time, any 32 whose
products hold a NaN or a float32 subnormal (which the instruction keeps, or
reads as zero, where chatkv gives 0x7fc0, or rounds it) converted one by one
as elsewhere; the same bits (the tests compare the two builds). A 256-token
SmolLM2 chunk's native call into memory not in the CPU's cache took, one
thread, 0.75x (int4), 0.89x (float16), 0.92x (fp8) and 0.94x (int8) the time
without them (1.07, 1.37, 1.00 and 0.87 ms; an exact chunk's 1.07 ms).
They write whole cache lines of bfloat16 with non-temporal stores, which
go to memory without reading the line into the cache first: a restore's
slots are not read again until the next turn's forward. A restore of an
int8 session from the page cache took 0.92x the time with them, fp8 0.94x,
int4 0.89x; and float16 codes then convert out of the staging buffer in
0.94x the time they took read into the slots and converted there. Codes
into float32 (a float32 pool's) are likewise converted 32 at a time and
stored so on CPUs with AVX-512, BF16 or not (fp8 and float16 restores
0.95x the time, int8 0.98x); the same bits as the plain C. CPUs without
them (most laptops and desktops, and AMD's before Zen 4) run the same
conversions written for AVX2 and F16C, 16 elements at a time, rounding to
bfloat16 with integer operations and storing non-temporally; int4 codes
into float32 take that code on every CPU with AVX2. A 256-token SmolLM2
chunk's conversion into float32 (the default dtype there), one thread,
against the plain C's x86-64-v3 clone: float16 0.5x the time, fp8 0.42x,
int4 0.6x to 0.7x, int8 0.65x to 0.8x, at or near an exact chunk's copy;
into bfloat16 int8 0.78x, int4 0.85x, fp8 0.60x, float16 0.3x (the
library built with ``-DCHATKV_AVX2_ONLY``, which takes the AVX2 code
wherever it can, on this project's AVX-512 VM).

The build runs in a background thread (:func:`prepare_in_background`: a
Store starts it when it opens), with the C compiler (``$CC``, else ``cc``)
into the user's cache directory (``readhash-<tag>.so``, the tag a hash of the
source, the compiler and its flags; about 1 s); later processes load that
file, and a new build removes the libraries unused for a month. A read never waits
for it: until it is ready (or where it cannot be: no compiler, no exported
xxhash functions, ``CHATKV_NATIVE_READ=0``), :func:`reader` returns None and
chunks are read in Python, as before; the log says once why.
"""

from __future__ import annotations

import array
import ctypes
import errno
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import sysconfig
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: ``0`` keeps chunk reads in Python (:func:`reader` returns None).
NATIVE_ENV = "CHATKV_NATIVE_READ"

#: What the C function returns when the file ends before the pieces do.
_SHORT_READ = -(1 << 40)

#: Element types a converted piece may hold in the file (:class:`Convert`), by
#: name (as torch spells them; ``uint4x2``: two 4-bit codes a byte, the low
#: nibble first), with their code in the C source and their bits.
SOURCE_TYPES: dict[str, tuple[int, int]] = {
    "int8": (1, 8), "float8_e4m3fn": (2, 8), "float16": (3, 16), "bfloat16": (4, 16), "float32": (5, 32),
    "uint4x2": (6, 4)}
#: Element types a converted piece may be written as, likewise.
TARGET_TYPES: dict[str, tuple[int, int]] = {"float32": (1, 4), "bfloat16": (2, 2)}

_SOURCE = r"""
#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

typedef int (*chatkv_update_fn)(void *state, const void *input, size_t length);
typedef void *(*chatkv_create_fn)(void);
typedef int (*chatkv_reset_fn)(void *state);
typedef struct { uint64_t low64, high64; } chatkv_hash128;
typedef chatkv_hash128 (*chatkv_digest_fn)(const void *state);
typedef int (*chatkv_free_fn)(void *state);

/* Element types of a converted piece: in the file, then where it goes. */
enum { SRC_INT8 = 1, SRC_E4M3 = 2, SRC_F16 = 3, SRC_BF16 = 4, SRC_F32 = 5, SRC_U4 = 6 };
enum { DST_F32 = 1, DST_BF16 = 2 };

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && !defined(CHATKV_NO_CLONES)
/* Conversions built three times (AVX-512, AVX2, any x86-64); the loader picks one. */
#define CHATKV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
/* And those into bfloat16 once more for CPUs with AVX-512 BF16 (chosen at run time). */
#define CHATKV_BF16_FAST 1
#include <immintrin.h>
#define CHATKV_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,f16c")))
/* And those into float32 for CPUs with AVX-512 (with or without BF16). */
#define CHATKV_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c")))
#else
#define CHATKV_CLONES
#endif

static inline float chatkv_from_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

/* float32 to bfloat16, rounded to nearest even (as torch rounds); a NaN is 0x7fc0. */
static inline uint16_t chatkv_bf16(float f)
{
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0u;
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* float16 to float32, exact, without branches (so that loops of it vectorize):
   the half's exponent and mantissa bits shifted into place read as a float32
   2^112 times too small (subnormal halves too), then rescaled exactly;
   infinities and NaNs get the float32 exponent of all ones instead. The
   choice is made with a mask, not a conditional: GCC 12 left loops of the
   conditional scalar ("control flow in loop"), which made every conversion
   of float16 codes on a CPU without AVX-512 four times slower. */
static inline float chatkv_f16(uint16_t h)
{
    uint32_t bits = (uint32_t)(h & 0x7fffu) << 13, b;
    float f = chatkv_from_bits(bits) * 0x1p112f;
    memcpy(&b, &f, 4);
    const uint32_t special = 0u - (uint32_t)(bits >= 0x0f800000u);  /* all ones for an infinity or a NaN */
    b = (b & ~special) | ((bits | 0x7f800000u) & special);
    return chatkv_from_bits(b | (uint32_t)(h & 0x8000u) << 16);
}

/* float8 e4m3fn to float32, exact, without branches (as chatkv_f16, with a
   mask): no infinities, and S.1111.111 is NaN. */
static inline float chatkv_e4m3(uint8_t c)
{
    uint32_t bits = (uint32_t)(c & 0x7fu) << 20;
    float f = chatkv_from_bits(bits) * 0x1p120f;
    uint32_t b;
    memcpy(&b, &f, 4);
    const uint32_t nan = 0u - (uint32_t)((c & 0x7fu) == 0x7fu);  /* all ones for S.1111.111 */
    b = (b & ~nan) | (0x7fc00000u & nan);
    return chatkv_from_bits(b | (uint32_t)(c & 0x80u) << 24);
}

#define LOAD_INT8(x) ((float)(x))
#define LOAD_E4M3(x) chatkv_e4m3(x)
#define LOAD_F16(x) chatkv_f16(x)
#define LOAD_BF16(x) chatkv_from_bits((uint32_t)(x) << 16)
#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
#define STORE_BF16(x) chatkv_bf16(x)

/* rows of row elements each: out = in * (that row's scale, or 1), computed in
   float32 and rounded once to the destination type. */
/* rows of row elements each: out = in * (that row's scale, or 1), computed in
   float32 and rounded once to the destination type. Rows of 64 and 128 (the
   usual head sizes) are unrolled with their length known. */
#define CHATKV_ROWS(name, src_t, dst_t, load, store)                                                \
    static inline __attribute__((always_inline)) void name##_n(const src_t *__restrict in,         \
            dst_t *__restrict out, long long rows, long long row, const float *__restrict scale)    \
    {                                                                                               \
        for (long long r = 0; r < rows; r++) {                                                      \
            const float s = scale ? scale[r] : 1.0f;                                                \
            const src_t *__restrict a = in + r * row;                                               \
            dst_t *__restrict o = out + r * row;                                                    \
            for (long long i = 0; i < row; i++)                                                     \
                o[i] = store(load(a[i]) * s);                                                       \
        }                                                                                           \
    }                                                                                               \
    CHATKV_CLONES void name(const src_t *__restrict in, dst_t *__restrict out, long long rows,     \
                            long long row, const float *__restrict scale)                          \
    {                                                                                               \
        if (!scale)                                                                                 \
            name##_n(in, out, 1, rows * row, scale);                                                \
        else if (row == 64)                                                                         \
            name##_n(in, out, rows, 64, scale);                                                     \
        else if (row == 128)                                                                        \
            name##_n(in, out, rows, 128, scale);                                                    \
        else                                                                                        \
            name##_n(in, out, rows, row, scale);                                                    \
    }

CHATKV_ROWS(chatkv_rows_i8_f32, int8_t, float, LOAD_INT8, STORE_F32)
CHATKV_ROWS(chatkv_rows_i8_bf16, int8_t, uint16_t, LOAD_INT8, STORE_BF16)
CHATKV_ROWS(chatkv_rows_e4m3_f32, uint8_t, float, LOAD_E4M3, STORE_F32)
CHATKV_ROWS(chatkv_rows_e4m3_bf16, uint8_t, uint16_t, LOAD_E4M3, STORE_BF16)
CHATKV_ROWS(chatkv_rows_f16_f32, uint16_t, float, LOAD_F16, STORE_F32)
CHATKV_ROWS(chatkv_rows_f16_bf16, uint16_t, uint16_t, LOAD_F16, STORE_BF16)
CHATKV_ROWS(chatkv_rows_bf16_f32, uint16_t, float, LOAD_BF16, STORE_F32)
CHATKV_ROWS(chatkv_rows_bf16_bf16, uint16_t, uint16_t, LOAD_BF16, STORE_BF16)
CHATKV_ROWS(chatkv_rows_f32_f32, float, float, LOAD_F32, STORE_F32)
CHATKV_ROWS(chatkv_rows_f32_bf16, float, uint16_t, LOAD_F32, STORE_BF16)

#ifdef CHATKV_BF16_FAST
/* The conversions into bfloat16 above, 32 elements at a time with AVX-512
   BF16's rounding instruction (to nearest even, as chatkv_bf16): the same
   bits, as long as no product is a NaN (which it keeps, where chatkv_bf16
   gives 0x7fc0) or a float32 subnormal (which it reads as zero): any 32
   elements holding one are converted as above, one by one; so is the end of
   a row shorter than 32. Each LOADn gives 16 elements as float32, exactly;
   SPECIALn says whether 32 codes hold one that is not a number (e4m3's
   S.1111.111, which the float16 route below would read as a number). */
static inline int chatkv_has_avx512(void)  /* (the conversions into float32) */
{
#ifdef CHATKV_AVX2_ONLY  /* (a build that takes the AVX2 code wherever it can: the tests compare it) */
    return 0;
#endif
    static int has = -1;  /* (a race writes the same value) */
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
              && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
              && __builtin_cpu_supports("f16c");
    }
    return has;
}

static inline int chatkv_has_bf16(void)
{
    return chatkv_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

/* The conversions for CPUs without AVX-512 (or, into bfloat16, without its
   BF16 instructions): AVX2 and F16C, 16 elements a step. */
static inline int chatkv_has_avx2(void)
{
    static int has = -1;
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    }
    return has;
}

#define LOAD16_INT8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define LOAD16_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
/* The float16 at p in the lanes of mask m (the rest 0), not reading past them. */
#define LOAD16_F16_FIRST(p, m) _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p))
#define LOAD16_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(          \
                                                                (const __m256i *)(p))), 16))
#define LOAD16_F32(p) _mm512_loadu_ps(p)
/* LOAD32_x(p, lo, hi): 32 elements at p as float32 into lo and hi, 16 each, exactly. */
#define LOAD32_INT8(p, lo, hi) ((lo) = LOAD16_INT8(p), (hi) = LOAD16_INT8((p) + 16))
#define LOAD32_F16(p, lo, hi) ((lo) = LOAD16_F16(p), (hi) = LOAD16_F16((p) + 16))
#define LOAD32_BF16(p, lo, hi) ((lo) = LOAD16_BF16(p), (hi) = LOAD16_BF16((p) + 16))
#define LOAD32_F32(p, lo, hi) ((lo) = LOAD16_F32(p), (hi) = LOAD16_F32((p) + 16))
/* e4m3 codes 2^-120 times (see CHATKV_FAST_ROWS's unit), as chatkv_e4m3
   reads them: each code sign-extended to 32 bits and shifted 20 up is, with
   bits 27 to 30 cleared, the float32 of that value (sign, then exponent and
   mantissa; subnormal codes are subnormal float32s, which the multiply by
   the scale folded with 2^120 reads exactly). Integer operations only: the
   float16 route (shifted into halves, widened by F16C) took 1.06x the time
   (a chunk's native read, one thread). */
#define LOAD32_E4M3(p, lo, hi) chatkv_e4m3_32((const uint8_t *)(p), &(lo), &(hi))
#define SPECIAL32_NONE(p) 0
/* 32 e4m3 codes holding a NaN (S.1111.111, which LOAD32_E4M3 reads as a number). */
#define SPECIAL32_E4M3(p) _mm256_cmpeq_epi8_mask(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p)),  \
                                                                   _mm256_set1_epi8(0x7f)), _mm256_set1_epi8(0x7f))

/* lo and hi (32 products) rounded to bfloat16 into o, 1; or 0, o untouched,
   where one is a NaN or a float32 subnormal (for the caller to convert one by one).
   Where o is a whole cache line, a non-temporal store: written
   to memory without the line being read into the cache first (a restore's
   slots are read by the next turn's forward, not now), which took a 6 MB
   chunk's int8 codes into bfloat16 slots 0.25 ms against 0.35 (one thread,
   this project's AMD VM); chatkv_read_pieces fences them before it returns.
   (Float16 codes into bfloat16 slots took 0.94x the time read into the
   staging buffer and converted out of it so, as against read into their
   slots and converted there, in restores alternating with each other.) */
CHATKV_AVX512_BF16 static inline int chatkv_put32(uint16_t *o, __m512 lo, __m512 hi)
{
    if (_mm512_fpclass_ps_mask(lo, 0xa1) | _mm512_fpclass_ps_mask(hi, 0xa1))  /* QNaN, SNaN, subnormal */
        return 0;
    const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    if (((uintptr_t)o & 63) == 0)
        _mm512_stream_si512((void *)o, v);
    else
        _mm512_storeu_si512((void *)o, v);
    return 1;
}

CHATKV_AVX512 static inline void chatkv_e4m3_32(const uint8_t *p, __m512 *lo, __m512 *hi)
{
    const __m512i m = _mm512_set1_epi32((int)0x87f00000);
    const __m512i a = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
    *lo = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(a, 20), m));
    *hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, 20), m));
}

/* Whether every one of the n scales times unit (a power of two) is finite:
   each row's products then come from one multiply (see CHATKV_FAST_ROWS). */
static inline int chatkv_folds(const float *scale, long long n, float unit)
{
    if (unit == 1.0f)
        return 1;  /* (a scale that is not finite is used as it is either way) */
    int finite = 1;
    for (long long r = 0; r < n; r++)
        finite &= __builtin_isfinite(scale[r] * unit);
    return finite;
}

/* Vectors of step / 2 float32s, as a width's code makes and multiplies them. */
#define CHATKV_W512 __m512, 32, _mm512_set1_ps, _mm512_mul_ps
#define CHATKV_W256 __m256, 16, _mm256_set1_ps, _mm256_mul_ps

/* load32 gives step elements (two vec_t: 32 with AVX-512, 16 with AVX2)
   unit times smaller than load does (a power of two: 1, or 2^120 for
   e4m3): a row's products are the loaded values times unit s in one
   multiply where that is finite (the same real product, rounded once),
   else times unit and then s; without a scale they are multiplied only
   where unit is not 1 or always says so. put32 writes step products as
   dst_t (or returns 0 for them to be written one by one, each as store
   writes it); so are any step elements that special32 finds, and the end
   of a row shorter than step. */
#define CHATKV_FAST_ROWS(...) CHATKV_FAST_ROWS_(__VA_ARGS__)
#define CHATKV_FAST_ROWS_(vec_t, step, set1, mul, name, target, dst_t, src_t, load, load32, unit, special32, always, \
                          put32, store)                                                             \
    target static void name(const src_t *in, dst_t *out, long long rows, long long row, const float *scale) \
    {                                                                                               \
        if (scale && row >= (step) && row % (step) == 0 && chatkv_folds(scale, rows, unit)) {       \
            /* Whole steps, every scale folding the unit: one flat loop (a row of 64, two 32s,     \
               left the row loop's set-up as much work as its conversion). */                      \
            const long long per = row / (step), groups = rows * per;                                \
            const float *sp = scale;                                                                \
            vec_t vs = set1(*sp * (unit));                                                          \
            for (long long g = 0, k = 0; g < groups; g++) {                                         \
                const long long i = g * (step);                                                     \
                vec_t lo, hi;                                                                       \
                load32(in + i, lo, hi);                                                             \
                lo = mul(lo, vs);                                                                   \
                hi = mul(hi, vs);                                                                   \
                if (special32(in + i) || !put32(out + i, lo, hi))                                   \
                    for (long long j = i; j < i + (step); j++)                                      \
                        out[j] = store(load(in[j]) * *sp);                                          \
                if (++k == per && g + 1 < groups) {                                                 \
                    k = 0;                                                                          \
                    vs = set1(*++sp * (unit));                                                      \
                }                                                                                   \
            }                                                                                       \
            return;                                                                                 \
        }                                                                                           \
        if (!scale) {                                                                               \
            row *= rows;                                                                            \
            rows = 1;                                                                               \
        }                                                                                           \
        for (long long r = 0; r < rows; r++) {                                                      \
            const src_t *a = in + r * row;                                                          \
            dst_t *o = out + r * row;                                                               \
            const float s = scale ? scale[r] : 1.0f, su = s * (unit);                               \
            const int folded = __builtin_isfinite(su);                                              \
            const vec_t vs = set1(folded ? su : s), vu = set1(unit);                                \
            long long i = 0;                                                                        \
            for (; i + (step) <= row; i += (step)) {                                                \
                vec_t lo, hi;                                                                       \
                load32(a + i, lo, hi);                                                              \
                if ((unit) != 1.0f && !folded) {                                                    \
                    lo = mul(lo, vu);                                                               \
                    hi = mul(hi, vu);                                                               \
                }                                                                                   \
                if (scale || (unit) != 1.0f || (always)) {                                          \
                    lo = mul(lo, vs);                                                               \
                    hi = mul(hi, vs);                                                               \
                }                                                                                   \
                if (special32(a + i) || !put32(o + i, lo, hi))                                      \
                    for (long long j = i; j < i + (step); j++)                                      \
                        o[j] = store(load(a[j]) * s);                                               \
            }                                                                                       \
            for (; i < row; i++)                                                                    \
                o[i] = store(load(a[i]) * s);                                                       \
        }                                                                                           \
    }
#define CHATKV_FAST_BF16(name, src_t, load, load32, unit, special32)                               \
    CHATKV_FAST_ROWS(CHATKV_W512, name, CHATKV_AVX512_BF16, uint16_t, src_t, load, load32, unit, special32, 0,  \
                     chatkv_put32, chatkv_bf16)

/* The code types both fast conversions read, each once: X(chatkv_fast_<type>_<to>,
   its C type, loads, unit and special32), for CHATKV_FAST_BF16 and CHATKV_FAST_F32. */
#define CHATKV_FAST_SOURCES(X, to)                                                                  \
    X(chatkv_fast_i8_##to, int8_t, LOAD_INT8, LOAD32_INT8, 1.0f, SPECIAL32_NONE)                     \
    X(chatkv_fast_e4m3_##to, uint8_t, LOAD_E4M3, LOAD32_E4M3, 0x1p120f, SPECIAL32_E4M3)              \
    X(chatkv_fast_f16_##to, uint16_t, LOAD_F16, LOAD32_F16, 1.0f, SPECIAL32_NONE)                    \
    X(chatkv_fast_bf16_##to, uint16_t, LOAD_BF16, LOAD32_BF16, 1.0f, SPECIAL32_NONE)

CHATKV_FAST_SOURCES(CHATKV_FAST_BF16, bf16)
CHATKV_FAST_BF16(chatkv_fast_f32_bf16, float, LOAD_F32, LOAD32_F32, 1.0f, SPECIAL32_NONE)

/* 32 float32 products into o, non-temporally where o starts a cache line
   (see chatkv_put32); 1. */
CHATKV_AVX512 static inline int chatkv_put32_f32(float *o, __m512 lo, __m512 hi)
{
    if (((uintptr_t)o & 63) == 0) {  /* (and so is o + 16) */
        _mm512_stream_ps(o, lo);
        _mm512_stream_ps(o + 16, hi);
    } else {
        _mm512_storeu_ps(o, lo);
        _mm512_storeu_ps(o + 16, hi);
    }
    return 1;
}

/* The conversions into float32 of CHATKV_ROWS with AVX-512 (BF16 or not),
   written as chatkv_put32 writes bfloat16: the same bits, each product the
   same float32 multiply (always made, by 1 without a scale, so that a
   signaling NaN comes out quiet as there); any 32 e4m3 codes holding a NaN
   are converted one by one. */
#define CHATKV_FAST_F32(name, src_t, load, load32, unit, special32)                                \
    CHATKV_FAST_ROWS(CHATKV_W512, name, CHATKV_AVX512, float, src_t, load, load32, unit, special32, 1,        \
                     chatkv_put32_f32, STORE_F32)

CHATKV_FAST_SOURCES(CHATKV_FAST_F32, f32)

/* The same conversions with AVX2 and F16C, 16 elements a step (CPUs without
   AVX-512; into bfloat16, those without its BF16 instructions too). Each
   LOAD8 gives 8 elements as float32, exactly. Products are rounded to
   bfloat16 as chatkv_bf16 rounds them (to nearest even on the bits, a NaN
   0x7fc0), eight at a time with integer operations, so that only e4m3's
   NaN codes are converted one by one; whole 32-byte stores go non-temporal
   (see chatkv_put32). */
#define CHATKV_AVX2 __attribute__((target("avx2,f16c")))
#define LOAD8_INT8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define LOAD8_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD8_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(            \
                                                             (const __m128i *)(p))), 16))
#define LOAD8_F32(p) _mm256_loadu_ps(p)
#define LOAD16_INT8_2(p, lo, hi) ((lo) = LOAD8_INT8(p), (hi) = LOAD8_INT8((p) + 8))
#define LOAD16_F16_2(p, lo, hi) ((lo) = LOAD8_F16(p), (hi) = LOAD8_F16((p) + 8))
#define LOAD16_BF16_2(p, lo, hi) ((lo) = LOAD8_BF16(p), (hi) = LOAD8_BF16((p) + 8))
#define LOAD16_F32_2(p, lo, hi) ((lo) = LOAD8_F32(p), (hi) = LOAD8_F32((p) + 8))
#define LOAD16_E4M3_2(p, lo, hi) chatkv_e4m3_16((const uint8_t *)(p), &(lo), &(hi))
#define SPECIAL16_NONE(p) 0
/* 16 e4m3 codes holding a NaN (S.1111.111). */
#define SPECIAL16_E4M3(p) _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(_mm_loadu_si128((const __m128i *)(p)),  \
                                                                           _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f)))

/* 16 e4m3 codes as LOAD32_E4M3 reads 32 (2^-120 times their value). */
CHATKV_AVX2 static inline void chatkv_e4m3_16(const uint8_t *p, __m256 *lo, __m256 *hi)
{
    const __m256i m = _mm256_set1_epi32((int)0x87f00000);
    const __m128i x = _mm_loadu_si128((const __m128i *)p);
    const __m256i a = _mm256_cvtepi8_epi32(x), b = _mm256_cvtepi8_epi32(_mm_srli_si128(x, 8));
    *lo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(a, 20), m));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), m));
}

/* 8 float32 rounded to bfloat16 as chatkv_bf16 rounds them, each in the
   low half of its 32 bits. */
CHATKV_AVX2 static inline __m256i chatkv_bf16_8(__m256 x)
{
    const __m256i b = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

/* 16 products into o as bfloat16 (non-temporally where o starts 32 bytes); 1. */
CHATKV_AVX2 static inline int chatkv_put16(uint16_t *o, __m256 lo, __m256 hi)
{
    /* (packing works within 128-bit lanes: the permute puts the 64-bit quarters in order) */
    const __m256i v = _mm256_permute4x64_epi64(_mm256_packus_epi32(chatkv_bf16_8(lo), chatkv_bf16_8(hi)), 0xd8);
    if (((uintptr_t)o & 31) == 0)
        _mm256_stream_si256((__m256i *)o, v);
    else
        _mm256_storeu_si256((__m256i *)o, v);
    return 1;
}

/* 16 products into o as float32, likewise; 1. */
CHATKV_AVX2 static inline int chatkv_put16_f32(float *o, __m256 lo, __m256 hi)
{
    if (((uintptr_t)o & 31) == 0) {  /* (and so is o + 8) */
        _mm256_stream_ps(o, lo);
        _mm256_stream_ps(o + 8, hi);
    } else {
        _mm256_storeu_ps(o, lo);
        _mm256_storeu_ps(o + 8, hi);
    }
    return 1;
}

#define CHATKV_AVX2_SOURCES(X, to)                                                                  \
    X(chatkv_avx2_i8_##to, int8_t, LOAD_INT8, LOAD16_INT8_2, 1.0f, SPECIAL16_NONE)                   \
    X(chatkv_avx2_e4m3_##to, uint8_t, LOAD_E4M3, LOAD16_E4M3_2, 0x1p120f, SPECIAL16_E4M3)            \
    X(chatkv_avx2_f16_##to, uint16_t, LOAD_F16, LOAD16_F16_2, 1.0f, SPECIAL16_NONE)                  \
    X(chatkv_avx2_bf16_##to, uint16_t, LOAD_BF16, LOAD16_BF16_2, 1.0f, SPECIAL16_NONE)
#define CHATKV_AVX2_BF16(name, src_t, load, load16, unit, special16)                               \
    CHATKV_FAST_ROWS(CHATKV_W256, name, CHATKV_AVX2, uint16_t, src_t, load, load16, unit, special16, 0,         \
                     chatkv_put16, chatkv_bf16)
#define CHATKV_AVX2_F32(name, src_t, load, load16, unit, special16)                                \
    CHATKV_FAST_ROWS(CHATKV_W256, name, CHATKV_AVX2, float, src_t, load, load16, unit, special16, 1,            \
                     chatkv_put16_f32, STORE_F32)
CHATKV_AVX2_SOURCES(CHATKV_AVX2_BF16, bf16)
CHATKV_AVX2_SOURCES(CHATKV_AVX2_F32, f32)
CHATKV_AVX2_BF16(chatkv_avx2_f32_bf16, float, LOAD_F32, LOAD16_F32_2, 1.0f, SPECIAL16_NONE)

/* Each conversion's best code for the CPU: the AVX-512 code where it has
   what that needs (fast), else the AVX2 code where it has AVX2 and F16C,
   else the plain C (its target_clones). */
#define CHATKV_TO_BF16(fast, avx2, portable) (chatkv_has_bf16() ? fast : chatkv_has_avx2() ? avx2 : portable)
#define CHATKV_TO_F32(fast, avx2, portable) (chatkv_has_avx512() ? fast : chatkv_has_avx2() ? avx2 : portable)
#else
#define CHATKV_TO_BF16(fast, avx2, portable) portable
#define CHATKV_TO_F32(fast, avx2, portable) portable
#endif

/* n float16 values at h as float32 into f, each as chatkv_f16 gives it (an
   int4 block's scales and offsets). */
static void chatkv_f16_run(const uint16_t *__restrict h, float *__restrict f, long long n)
{
    for (long long j = 0; j < n; j++)
        f[j] = chatkv_f16(h[j]);
}

#ifdef CHATKV_BF16_FAST
/* chatkv_f16_run 16 at a time (F16C's widening, exact as chatkv_f16 is;
   a signalling NaN comes out quiet, which the products it scales are
   anyway). Per int4 chunk of SmolLM2's this was 0.17 ms of 0.8, one value
   at a time. */
CHATKV_AVX512 static void chatkv_fast_f16_run(const uint16_t *__restrict h, float *__restrict f, long long n)
{
    long long j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(f + j, LOAD16_F16(h + j));
    if (j < n) {
        const __mmask16 m = (__mmask16)((1u << (n - j)) - 1u);
        _mm512_mask_storeu_ps(f + j, m, LOAD16_F16_FIRST(h + j, m));
    }
}

/* chatkv_f16_run 8 at a time with F16C (as chatkv_fast_f16_run). */
CHATKV_AVX2 static void chatkv_avx2_f16_run(const uint16_t *__restrict h, float *__restrict f, long long n)
{
    long long j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(f + j, LOAD8_F16(h + j));
    for (; j < n; j++)
        f[j] = chatkv_f16(h[j]);
}
#endif

/* int4 codes, two per byte (the low nibble first), half bytes of them:
   out = code * sf + zf per element, each step rounded in float32, then
   rounded to the destination type (sf, zf: that row's scales and offsets,
   one per element). */
#define CHATKV_NIBBLES(name, dst_t, store)                                                          \
    CHATKV_CLONES void name(const uint8_t *__restrict a, dst_t *__restrict o, long long half,       \
                            const float *__restrict sf, const float *__restrict zf)                 \
    {                                                                                               \
        float c[512];                                                                               \
        for (long long at = 0; at < half; at += 256) {                                              \
            const long long n = half - at < 256 ? half - at : 256;                                  \
            for (long long j = 0; j < n; j++) {                                                     \
                c[2 * j] = (float)(a[at + j] & 15u);                                                \
                c[2 * j + 1] = (float)(a[at + j] >> 4);                                             \
            }                                                                                       \
            for (long long i = 0; i < 2 * n; i++)                                                   \
                o[2 * at + i] = store(c[i] * sf[2 * at + i] + zf[2 * at + i]);                      \
        }                                                                                           \
    }

CHATKV_NIBBLES(chatkv_nibbles_f32, float, STORE_F32)
CHATKV_NIBBLES(chatkv_nibbles_bf16, uint16_t, STORE_BF16)

/* One piece (see chatkv_read_pieces). */
struct chatkv_piece {
    long long addr;   /* where its bytes go, or (off < 0) are */
    long long len;    /* bytes in the file (or hashed) */
    long long off;    /* offset in the file; < 0: only hash len bytes at addr */
    long long conv;   /* 0: read as is; -1: read as is, not hashed; else 16 * source type + destination type */
    long long row;    /* elements per row, when converted */
    long long scale;  /* address of the scales (float32; float16 for int4), or 0 */
    long long zero;   /* int4: address of the offsets (float16) */
    long long block;  /* int4 with one (scale, offset) per element over a block of rows: rows per block */
    long long phase;  /* ... and rows of the piece's first block before the piece */
    long long group;  /* int4 with (scale, offset) per group of elements of each row: elements per group */
    long long spans;  /* 0: its bytes go to addr on; else the address of count int64 offsets from addr, */
    long long sizes;  /* ... and of their count int64 sizes: its bytes fill those stretches in turn */
    long long count;  /* (each stretch whole rows when converted; empty ones skipped) */
    long long runs;   /* planes (nruns > 0): spans holds count planes' offsets from addr, and this the */
    long long nruns;  /* ... address of nruns int64 triples (start, end, at): bytes start .. end - 1 of */
    long long lo;     /* ... each plane are bytes at .. at + end - start - 1 of its runs put end to end; */
    long long hi;     /* ... the piece fills bytes lo .. hi - 1 of those of each plane in turn */
};

/* Where piece q's next bytes go: *p and *room (its bytes) for the first
   non-empty stretch from *j on, *j moved past it; -EINVAL past its last. */
static long long chatkv_stretch(const struct chatkv_piece *q, long long *j, char **p, long long *room)
{
    if (q->nruns > 0) {  /* planes: stretch j is run j % nruns of plane j / nruns, cut to lo .. hi - 1 */
        const long long *starts = (const long long *)(size_t)q->spans, *runs = (const long long *)(size_t)q->runs;
        while (*j < q->count * q->nruns) {
            const long long plane = *j / q->nruns, *r = runs + 3 * (*j % q->nruns);
            const long long x = q->lo > r[2] ? q->lo : r[2];
            const long long y = q->hi < r[2] + r[1] - r[0] ? q->hi : r[2] + r[1] - r[0];
            (*j)++;
            if (x < y) {
                *p = (char *)(size_t)q->addr + starts[plane] + r[0] + (x - r[2]);
                *room = y - x;
                return 0;
            }
        }
        return -(long long)EINVAL;
    }
    const long long *offsets = (const long long *)(size_t)q->spans, *sizes = (const long long *)(size_t)q->sizes;
    while (*j < q->count && sizes[*j] <= 0)
        (*j)++;
    if (*j >= q->count)
        return -(long long)EINVAL;
    *p = (char *)(size_t)q->addr + offsets[*j];
    *room = sizes[*j];
    (*j)++;
    return 0;
}

/* rows rows of row elements at in, converted as conv says (each row times
   its scale where scale is not NULL) into out (other memory). */
static void chatkv_convert(long long conv, const void *in, void *out, long long rows, long long row,
                           const float *scale)
{
    switch (conv) {
    case SRC_INT8 * 16 + DST_F32:
        CHATKV_TO_F32(chatkv_fast_i8_f32, chatkv_avx2_i8_f32, chatkv_rows_i8_f32)(in, out, rows, row, scale);
        break;
    case SRC_INT8 * 16 + DST_BF16:
        CHATKV_TO_BF16(chatkv_fast_i8_bf16, chatkv_avx2_i8_bf16, chatkv_rows_i8_bf16)(in, out, rows, row, scale);
        break;
    case SRC_E4M3 * 16 + DST_F32:
        CHATKV_TO_F32(chatkv_fast_e4m3_f32, chatkv_avx2_e4m3_f32, chatkv_rows_e4m3_f32)(in, out, rows, row, scale);
        break;
    case SRC_E4M3 * 16 + DST_BF16:
        CHATKV_TO_BF16(chatkv_fast_e4m3_bf16, chatkv_avx2_e4m3_bf16, chatkv_rows_e4m3_bf16)(in, out, rows, row, scale);
        break;
    case SRC_F16 * 16 + DST_F32:
        CHATKV_TO_F32(chatkv_fast_f16_f32, chatkv_avx2_f16_f32, chatkv_rows_f16_f32)(in, out, rows, row, scale);
        break;
    case SRC_F16 * 16 + DST_BF16:
        CHATKV_TO_BF16(chatkv_fast_f16_bf16, chatkv_avx2_f16_bf16, chatkv_rows_f16_bf16)(in, out, rows, row, scale);
        break;
    case SRC_BF16 * 16 + DST_F32:
        CHATKV_TO_F32(chatkv_fast_bf16_f32, chatkv_avx2_bf16_f32, chatkv_rows_bf16_f32)(in, out, rows, row, scale);
        break;
    case SRC_BF16 * 16 + DST_BF16:
        CHATKV_TO_BF16(chatkv_fast_bf16_bf16, chatkv_avx2_bf16_bf16, chatkv_rows_bf16_bf16)(in, out, rows, row, scale);
        break;
    case SRC_F32 * 16 + DST_F32: chatkv_rows_f32_f32(in, out, rows, row, scale); break;
    case SRC_F32 * 16 + DST_BF16:
        CHATKV_TO_BF16(chatkv_fast_f32_bf16, chatkv_avx2_f32_bf16, chatkv_rows_f32_bf16)(in, out, rows, row, scale);
        break;
    }
}

/* int4 codes with one (scale, offset) per group of each row's elements: rows
   rows of row elements, half bytes each; code is expanded into c (row floats)
   first, then each group's elements are code * s + z with that group's s and
   z, each step rounded in float32, then rounded to the destination type. */
#define CHATKV_GROUPS(name, dst_t, store)                                                           \
    CHATKV_CLONES void name(const uint8_t *__restrict a, dst_t *__restrict o, long long rows,       \
                            long long row, long long group, const uint16_t *__restrict scale,       \
                            const uint16_t *__restrict zero, float *__restrict c)                   \
    {                                                                                               \
        const long long groups = row / group;                                                       \
        for (long long r = 0; r < rows; r++, a += row / 2, o += row) {                              \
            for (long long j = 0; j < row / 2; j++) {                                               \
                c[2 * j] = (float)(a[j] & 15u);                                                     \
                c[2 * j + 1] = (float)(a[j] >> 4);                                                  \
            }                                                                                       \
            for (long long g = 0; g < groups; g++) {                                                \
                const float s = chatkv_f16(scale[r * groups + g]), z = chatkv_f16(zero[r * groups + g]); \
                for (long long j = g * group; j < (g + 1) * group; j++)                             \
                    o[j] = store(c[j] * s + z);                                                     \
            }                                                                                       \
        }                                                                                           \
    }

CHATKV_GROUPS(chatkv_groups_f32, float, STORE_F32)
CHATKV_GROUPS(chatkv_groups_bf16, uint16_t, STORE_BF16)

#ifdef CHATKV_BF16_FAST
/* 16 bytes of int4 codes at p as 32 one-byte codes, in order (each byte's
   low nibble, then its high one): the first 16 in *first, the rest in
   *rest (with 128-bit operations, which this project's AMD CPU runs at
   twice the rate of 512-bit ones); CHATKV_CODES16 makes 16 of them float32. */
CHATKV_AVX512_BF16 static inline void chatkv_nibbles32(const uint8_t *p, __m128i *first, __m128i *rest)
{
    const __m128i x = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(x, m), high = _mm_and_si128(_mm_srli_epi16(x, 4), m);
    *first = _mm_unpacklo_epi8(low, high);
    *rest = _mm_unpackhi_epi8(low, high);
}
#define CHATKV_CODES16(w) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(w))
#define CHATKV_NIBBLE(a, i) ((float)(((a)[(i) / 2] >> ((i) % 2 * 4)) & 15u))

/* chatkv_nibbles_bf16 with AVX-512 BF16, 32 codes at a time (as CHATKV_FAST_BF16). */
CHATKV_AVX512_BF16 static void chatkv_fast_nibbles_bf16(const uint8_t *__restrict a, uint16_t *__restrict o,
                                                       long long half, const float *__restrict sf,
                                                       const float *__restrict zf)
{
    long long j = 0;
    for (; j + 16 <= half; j += 16) {
        const long long i = 2 * j;
        __m128i w0, w1;
        chatkv_nibbles32(a + j, &w0, &w1);
        const __m512 lo = _mm512_add_ps(_mm512_mul_ps(CHATKV_CODES16(w0), _mm512_loadu_ps(sf + i)),
                                        _mm512_loadu_ps(zf + i));
        const __m512 hi = _mm512_add_ps(_mm512_mul_ps(CHATKV_CODES16(w1), _mm512_loadu_ps(sf + i + 16)),
                                        _mm512_loadu_ps(zf + i + 16));
        if (!chatkv_put32(o + i, lo, hi))
            for (long long k = i; k < i + 32; k++)
                o[k] = chatkv_bf16(CHATKV_NIBBLE(a, k) * sf[k] + zf[k]);
    }
    for (long long k = 2 * j; k < 2 * half; k++)
        o[k] = chatkv_bf16(CHATKV_NIBBLE(a, k) * sf[k] + zf[k]);
}

/* chatkv_groups_bf16 with AVX-512 BF16, 32 codes of one group at a time,
   where groups and rows are whole 32s and a row has at most 16 groups (else
   as chatkv_groups_bf16), each row's scales and offsets widened at once. */
CHATKV_AVX512_BF16 static void chatkv_fast_groups_bf16(const uint8_t *__restrict a, uint16_t *__restrict o,
                                                      long long rows, long long row, long long group,
                                                      const uint16_t *__restrict scale,
                                                      const uint16_t *__restrict zero, float *__restrict c)
{
    const long long groups = row / group;
    if (group % 32 || row % 32 || groups > 16) {
        chatkv_groups_bf16(a, o, rows, row, group, scale, zero, c);
        return;
    }
    const __mmask16 m = (__mmask16)((1u << groups) - 1u);
    float sg[16], zg[16];  /* the row's scales and offsets, widened at once */
    for (long long r = 0; r < rows; r++, a += row / 2, o += row) {
        _mm512_storeu_ps(sg, LOAD16_F16_FIRST(scale + r * groups, m));
        _mm512_storeu_ps(zg, LOAD16_F16_FIRST(zero + r * groups, m));
        for (long long i = 0; i < row; i += 32) {
            const float s = sg[i / group], z = zg[i / group];
            const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z);
            __m128i w0, w1;
            chatkv_nibbles32(a + i / 2, &w0, &w1);
            const __m512 lo = _mm512_add_ps(_mm512_mul_ps(CHATKV_CODES16(w0), vs), vz);
            const __m512 hi = _mm512_add_ps(_mm512_mul_ps(CHATKV_CODES16(w1), vs), vz);
            if (!chatkv_put32(o + i, lo, hi))
                for (long long k = i; k < i + 32; k++)
                    o[k] = chatkv_bf16(CHATKV_NIBBLE(a, k) * s + z);
        }
    }
}

/* 8 bytes of int4 codes at p as 16 float32 codes, in order: the first 8 in
   *c0, the rest in *c1. */
CHATKV_AVX2 static inline void chatkv_nibbles16(const uint8_t *p, __m256 *c0, __m256 *c1)
{
    const __m128i x = _mm_loadl_epi64((const __m128i *)p), m = _mm_set1_epi8(15);
    const __m128i w = _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m));
    *c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(w));
    *c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(w, 8)));
}

/* chatkv_nibbles_<to> and chatkv_groups_<to> with AVX2, 16 codes a step
   (groups: where groups and rows are whole 16s, else as chatkv_groups_<to>),
   each product code * scale + offset as there, written by put16. */
#define CHATKV_AVX2_INT4(to, dst_t, put16, store)                                                   \
    CHATKV_AVX2 static void chatkv_avx2_nibbles_##to(const uint8_t *__restrict a, dst_t *__restrict o, \
                                                     long long half, const float *__restrict sf,     \
                                                     const float *__restrict zf)                     \
    {                                                                                               \
        long long j = 0;                                                                            \
        for (; j + 8 <= half; j += 8) {                                                             \
            const long long i = 2 * j;                                                              \
            __m256 c0, c1;                                                                          \
            chatkv_nibbles16(a + j, &c0, &c1);                                                      \
            put16(o + i, _mm256_add_ps(_mm256_mul_ps(c0, _mm256_loadu_ps(sf + i)), _mm256_loadu_ps(zf + i)), \
                  _mm256_add_ps(_mm256_mul_ps(c1, _mm256_loadu_ps(sf + i + 8)), _mm256_loadu_ps(zf + i + 8))); \
        }                                                                                           \
        for (long long k = 2 * j; k < 2 * half; k++)                                                \
            o[k] = store(CHATKV_NIBBLE(a, k) * sf[k] + zf[k]);                                      \
    }                                                                                               \
    CHATKV_AVX2 static void chatkv_avx2_groups_##to(const uint8_t *__restrict a, dst_t *__restrict o,  \
                                                    long long rows, long long row, long long group,   \
                                                    const uint16_t *__restrict scale,                 \
                                                    const uint16_t *__restrict zero, float *__restrict c) \
    {                                                                                               \
        if (group % 16 || row % 16) {                                                               \
            chatkv_groups_##to(a, o, rows, row, group, scale, zero, c);                             \
            return;                                                                                 \
        }                                                                                           \
        const long long groups = row / group;                                                      \
        for (long long r = 0; r < rows; r++, a += row / 2, o += row)                               \
            for (long long g = 0; g < groups; g++) {                                                \
                const __m256 vs = _mm256_set1_ps(chatkv_f16(scale[r * groups + g]));                \
                const __m256 vz = _mm256_set1_ps(chatkv_f16(zero[r * groups + g]));                 \
                for (long long i = g * group; i < (g + 1) * group; i += 16) {                       \
                    __m256 c0, c1;                                                                  \
                    chatkv_nibbles16(a + i / 2, &c0, &c1);                                          \
                    put16(o + i, _mm256_add_ps(_mm256_mul_ps(c0, vs), vz),                          \
                          _mm256_add_ps(_mm256_mul_ps(c1, vs), vz));                                \
                }                                                                                   \
            }                                                                                       \
    }
CHATKV_AVX2_INT4(bf16, uint16_t, chatkv_put16, chatkv_bf16)
CHATKV_AVX2_INT4(f32, float, chatkv_put16_f32, STORE_F32)
#define CHATKV_TO_AVX2(avx2, portable) (chatkv_has_avx2() ? avx2 : portable)
#else
#define CHATKV_TO_AVX2(avx2, portable) portable
#endif

/* rows int4 rows of piece q, done rows into it, from in to out; sf and zf
   hold q->row floats each (the scales and offsets of the row before). */
static void chatkv_convert_int4(const struct chatkv_piece *q, long long done, const uint8_t *in, char *out,
                                long long rows, float *sf, float *zf)
{
    const uint16_t *scale = (const uint16_t *)(size_t)q->scale, *zero = (const uint16_t *)(size_t)q->zero;
    const long long row = q->row, dst = q->conv % 16;
    if (q->group > 0) {  /* one (scale, offset) per group of each row */
        const long long groups = row / q->group;
        const uint16_t *s = scale + done * groups, *z = zero + done * groups;
        if (dst == DST_F32)  /* (the AVX2 code on CPUs with AVX-512 too: there is none of its own) */
            CHATKV_TO_AVX2(chatkv_avx2_groups_f32, chatkv_groups_f32)(in, (float *)out, rows, row, q->group, s, z,
                                                                     sf);
        else
            CHATKV_TO_BF16(chatkv_fast_groups_bf16, chatkv_avx2_groups_bf16, chatkv_groups_bf16)(
                in, (uint16_t *)out, rows, row, q->group, s, z, sf);
        return;
    }
    for (long long r = done; r < done + rows; r++) {
        if (r == done || (q->phase + r) % q->block == 0) {  /* one per element, per block of rows */
            const long long b = (q->phase + r) / q->block;
            CHATKV_TO_F32(chatkv_fast_f16_run, chatkv_avx2_f16_run, chatkv_f16_run)(scale + b * row, sf, row);
            CHATKV_TO_F32(chatkv_fast_f16_run, chatkv_avx2_f16_run, chatkv_f16_run)(zero + b * row, zf, row);
        }
        const uint8_t *a = in + (r - done) * (row / 2);
        if (dst == DST_F32)
            CHATKV_TO_AVX2(chatkv_avx2_nibbles_f32, chatkv_nibbles_f32)(a, (float *)out + (r - done) * row, row / 2,
                                                                       sf, zf);
        else
            CHATKV_TO_BF16(chatkv_fast_nibbles_bf16, chatkv_avx2_nibbles_bf16, chatkv_nibbles_bf16)(
                a, (uint16_t *)out + (r - done) * row, row / 2, sf, zf);
    }
}

static long long chatkv_fill(int fd, char *p, size_t want, long long at)  /* 0, -errno, or a short read */
{
    size_t done = 0;
    while (done < want) {
        ssize_t got = pread(fd, p + done, want - done, (off_t)(at + (long long)done));
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -(long long)errno;
        }
        if (got == 0)
            return -(1LL << 40);
        done += (size_t)got;
    }
    return 0;
}

/* For each of the n pieces in order: where off < 0, feed the len bytes at
   addr to the hash; where conv < 0, read len bytes from fd at offset off into
   addr, not hashed; else read len bytes from fd at offset off, at most slice
   bytes per pread, feeding each slice to the hash as soon as it lands: where
   conv is 0, into addr (or its stretches); else into a staging buffer, from
   which the slice's whole rows are converted into addr (or its stretches; see
   struct chatkv_piece and the conversions above). Returns the bytes read
   from fd, -errno after a failed read or allocation (-EINVAL: stretches
   that do not hold the piece in whole rows), or
   -(1 << 40) when the file ends before the pieces do. */
static long long chatkv_read_pieces(int fd, long long n, const struct chatkv_piece *pieces, long long slice,
                                    void *state, chatkv_update_fn update)
{
    static const long long src_size2[] = {0, 2, 2, 4, 4, 8, 1};  /* twice each source type's bytes */
    static const long long dst_size[] = {0, 4, 2};
    long long total = 0, status = 0;
    char *stage = NULL;
    float *expand = NULL;
    size_t staged = 0, expanded = 0;
    for (long long i = 0; i < n && status == 0; i++) {
        const struct chatkv_piece *q = &pieces[i];
        char *p = (char *)(size_t)q->addr;
        long long left = q->len, at = q->off;
        long long stretch = 0, room = q->spans ? 0 : LLONG_MAX;  /* bytes left where p points */
        if (at < 0) {
            update(state, p, (size_t)left);
            continue;
        }
        if (q->conv < 0) {  /* read whole, not hashed (a later piece hashes it from memory) */
            status = chatkv_fill(fd, p, (size_t)left, at);
            if (status == 0)
                total += left;
            continue;
        }
        if (q->conv == 0) {  /* straight into place, a slice at a time */
            while (left > 0 && status == 0) {
                if (room == 0 && (status = chatkv_stretch(q, &stretch, &p, &room)) != 0)
                    break;
                long long most = left < slice ? left : slice;
                size_t want = (size_t)(most < room ? most : room);
                status = chatkv_fill(fd, p, want, at);
                if (status == 0) {
                    update(state, p, want);
                    p += want;
                    room -= (long long)want;
                    at += (long long)want;
                    left -= (long long)want;
                    total += (long long)want;
                }
            }
            continue;
        }
        const long long src = q->conv / 16, dst = q->conv % 16;
        const long long row_bytes = q->row * src_size2[src] / 2;
        long long per = slice / row_bytes, done = 0;
        if (per < 1)
            per = 1;
        const long long out_row = q->row * dst_size[dst];
        if ((size_t)(per * row_bytes) > staged) {
            free(stage);
            staged = (size_t)(per * row_bytes);
            stage = malloc(staged);
        }
        if (src == SRC_U4 && (size_t)q->row > expanded) {
            free(expand);
            expanded = (size_t)q->row;
            expand = malloc(2 * expanded * sizeof(float));
        }
        if (!stage || (src == SRC_U4 && !expand)) {
            status = -(long long)ENOMEM;
            break;
        }
        const float *sc = (const float *)(size_t)q->scale;
        while (left > 0) {
            if (room == 0 && (status = chatkv_stretch(q, &stretch, &p, &room)) != 0)
                break;
            long long rows = left / row_bytes < per ? left / row_bytes : per;
            if (rows > room / out_row)
                rows = room / out_row;
            if (rows <= 0) {  /* (partial rows: the callers check first) */
                status = -(long long)EINVAL;
                break;
            }
            size_t want = (size_t)(rows * row_bytes);
            status = chatkv_fill(fd, stage, want, at);
            if (status != 0)
                break;
            update(state, stage, want);
            if (src == SRC_U4) {
                chatkv_convert_int4(q, done, (const uint8_t *)stage, p, rows, expand, expand + expanded);
            } else {
                chatkv_convert(q->conv, stage, p, rows, q->row, sc);
                if (sc)
                    sc += rows;
            }
            p += rows * out_row;
            room -= rows * out_row;
            done += rows;
            at += (long long)want;
            left -= (long long)want;
            total += (long long)want;
        }
    }
    free(stage);
    free(expand);
#ifdef CHATKV_BF16_FAST
    _mm_sfence();  /* the conversions' non-temporal stores visible before the caller goes on */
#endif
    return status != 0 ? status : total;
}

/* chatkv_read_pieces with a hash state of its own: made, reset, read into,
   digested into digest[0] (low 64 bits) and digest[1], and freed, through
   the xxhash functions in fns (create, reset, update, digest, free), all in
   this one call (each call through ctypes gives the GIL away and waits for
   it back). Returns as chatkv_read_pieces does (-ENOMEM where no state
   could be made too). */
long long chatkv_read_digest(int fd, long long n, const struct chatkv_piece *pieces, long long slice,
                             void *const *fns, uint64_t *digest)
{
    void *state = ((chatkv_create_fn)fns[0])();
    if (!state)
        return -(long long)ENOMEM;
    ((chatkv_reset_fn)fns[1])(state);
    long long got = chatkv_read_pieces(fd, n, pieces, slice, state, (chatkv_update_fn)fns[2]);
    if (got >= 0) {
        chatkv_hash128 h = ((chatkv_digest_fn)fns[3])(state);
        digest[0] = h.low64;
        digest[1] = h.high64;
    }
    ((chatkv_free_fn)fns[4])(state);
    return got;
}
"""


@dataclass(frozen=True)
class Convert:
    """How pieces read from the file are written (:meth:`NativeReads.read_hashed`):
    the rows of one tensor, each piece some of them.

    Attributes:
        source: the elements' type in the file (:data:`SOURCE_TYPES`).
        target: their type where they go (:data:`TARGET_TYPES`).
        row: elements per row; a piece's bytes are whole rows.
        scale: a buffer of one float32 per row of the tensor, each row's
            elements multiplied by it (in float32, rounded once to
            ``target``), or None for no scaling (a plain cast). For
            ``uint4x2`` codes, float16 scales as ``block`` or ``group`` says.
        zero: ``uint4x2`` only: float16 offsets, one per scale. Each element
            is ``code * scale + zero``, each step rounded in float32, then
            rounded once to ``target``.
        block: ``uint4x2`` with one (scale, zero) per element of a row,
            shared by each block of this many rows: ``scale`` holds a row
            of them per block.
        group: ``uint4x2`` with one (scale, zero) per group of this many
            elements of each row: ``scale`` holds ``row // group`` a row.
    """

    source: str
    target: str
    row: int
    scale: Any = None
    zero: Any = None
    block: int = 0
    group: int = 0


@dataclass(frozen=True, eq=False)
class Spans:
    """One destination of a read made of many stretches of a single buffer:
    the bytes it receives fill, in order, ``sizes[i]`` bytes at byte offset
    ``offsets[i]`` of ``memory`` (a writable, C-contiguous buffer). What a
    reader into many runs of one large buffer (the layers of a block pool's
    slots) passes instead of a view per run: :meth:`NativeReads.read_hashed`
    then hands its arrays to the C function, which moves from stretch to
    stretch itself, where a view per run cost a Python step each (a restored
    chunk has 60 or more).

    Attributes:
        memory: the buffer (kept alive by this object).
        offsets: int64 numpy array, each stretch's first byte in ``memory``.
        sizes: int64 numpy array of the same length, each stretch's bytes.
    """

    memory: Any
    offsets: Any
    sizes: Any

    @property
    def nbytes(self) -> int:
        """The bytes all the stretches hold together."""
        return int(self.sizes.sum())

    def check(self) -> memoryview:
        """``memory`` as a byte view, after checking that it is writable and
        C-contiguous and that every stretch lies inside it.

        Raises:
            TypeError: ``memory`` is read-only.
            ValueError: it is not C-contiguous, the arrays differ in length,
                or a stretch is negative or outside it.
        """
        view = memoryview(self.memory)
        if view.readonly:
            raise TypeError("a piece to be read into is read-only")
        if not view.c_contiguous:
            raise ValueError("a piece is not C-contiguous")
        if self.offsets.shape != self.sizes.shape or self.offsets.ndim != 1:
            raise ValueError("spans need as many offsets as sizes")
        if len(self.sizes) and (int(self.sizes.min()) < 0 or int(self.offsets.min()) < 0
                                or int((self.offsets + self.sizes).max()) > view.nbytes):
            raise ValueError(f"a span lies outside its {view.nbytes}-byte buffer")
        return view.cast("B")

    def views(self) -> list[memoryview]:
        """The stretches as views of ``memory``, in order (for reads that take
        buffers one by one), after :meth:`check`."""
        view = self.check()
        return [view[o: o + n] for o, n in zip(self.offsets.tolist(), self.sizes.tolist())]


class Planes:
    """Equal planes of one buffer that each receive the same runs of bytes: a
    block pool's layers, whose slots for a restore lie in the same runs of
    each plane (each layer's K, then its V). Checked once when made, so that
    each read into part of them (:meth:`span`, a :class:`PlaneSpans`) costs a
    few integer checks, not a check of every stretch: the offsets and runs
    are copies of its own, and it holds the buffer's export (the buffer
    cannot be resized while it lives). Made on a restore's critical path (by
    the engine's loop, before any chunk is read), so in plain Python: numpy's
    calls there, each run once a restore with cold caches, cost seven times
    what they cost in a loop.

    Attributes:
        memory: the buffer as a writable byte view.
        starts: each plane's first byte in ``memory`` (a tuple of ints).
        runs: the byte ranges ``(start, end)`` within a plane, in order.
        total: the bytes of one plane's runs put end to end.
    """

    def __init__(self, memory: Any, starts: Sequence[int], runs: Sequence[tuple[int, int]]) -> None:
        """Check and keep ``memory`` (writable, C-contiguous), ``starts``
        (each plane's offset in it) and ``runs``.

        Raises:
            TypeError: ``memory`` is read-only.
            ValueError: it is not C-contiguous, a run is reversed, or a run of
                a plane lies outside it.
        """
        view = memoryview(memory)
        if view.readonly:
            raise TypeError("planes to be read into are read-only")
        if not view.c_contiguous:
            raise ValueError("planes' memory is not C-contiguous")
        self.memory = view.cast("B")
        self.starts = tuple(int(start) for start in starts)
        self.runs = [(int(a), int(b)) for a, b in runs]
        table = []  # start, end, at: what the C function walks
        at = 0
        for a, b in self.runs:
            table += (a, b, at)
            at += b - a
        self.total = at
        if self.runs and self.starts and (
                min(a for a, _ in self.runs) < 0 or any(b < a for a, b in self.runs) or min(self.starts) < 0
                or max(self.starts) + max(b for _, b in self.runs) > self.memory.nbytes):
            raise ValueError(f"a run of a plane lies outside its {self.memory.nbytes}-byte buffer")
        self._table = array.array("q", table)  # (never written again: the C function reads it)
        self._export = ctypes.c_char.from_buffer(self.memory) if self.memory.nbytes else None
        self._address = ctypes.addressof(self._export) if self._export is not None else 0
        # Each (first, every)'s plane offsets, as the C function reads them; each
        # row size whose whole rows every run holds.
        self._strided: dict[tuple[int, int], array.array] = {}
        self._whole: dict[int, bool] = {}

    def span(self, lo: int, hi: int, first: int = 0, every: int = 1) -> "PlaneSpans":
        """Bytes ``lo .. hi - 1`` of the runs put end to end, of planes
        ``first``, ``first + every``, ... in turn, as one destination.

        Raises:
            ValueError: ``lo .. hi`` is not within :attr:`total`, or ``first``
                not below ``every``.
        """
        if not 0 <= lo <= hi <= self.total or not 0 <= first < every:
            raise ValueError(f"bytes {lo} to {hi} of planes from {first} by {every}: outside {self.total} bytes "
                             "of runs")
        starts = self._strided.get((first, every))
        if starts is None:
            starts = self._strided[(first, every)] = array.array("q", self.starts[first::every])
        return PlaneSpans(self, lo, hi, starts)

    def whole_rows(self, unit: int) -> bool:
        """Whether every run holds whole rows of ``unit`` bytes."""
        whole = self._whole.get(unit)
        if whole is None:
            whole = self._whole[unit] = unit > 0 and all((b - a) % unit == 0 for a, b in self.runs)
        return whole

    def views(self, plane: int, lo: int, hi: int) -> list[memoryview]:
        """Bytes ``lo .. hi - 1`` of the runs of plane ``plane``, put end to
        end, as views of :attr:`memory` (empty ones left out)."""
        return self._views_at(self.starts[plane], lo, hi)

    def _views_at(self, base: int, lo: int, hi: int) -> list[memoryview]:
        """:meth:`views` of the plane at byte ``base`` of :attr:`memory`."""
        out = []
        at = 0
        for a, b in self.runs:
            x, y = max(lo, at), min(hi, at + b - a)
            if x < y:
                out.append(self.memory[base + a + x - at: base + a + y - at])
            at += b - a
        return out


@dataclass(frozen=True, eq=False)
class PlaneSpans:
    """One destination of a read: bytes ``lo .. hi - 1`` of the runs of some
    of a :class:`Planes`' planes (``starts``, theirs), filled plane by plane,
    as a :class:`Spans` of those stretches would be. Made by
    :meth:`Planes.span`, which checked it; the C function finds the
    stretches itself."""

    planes: Planes
    lo: int
    hi: int
    starts: array.array

    @property
    def nbytes(self) -> int:
        """The bytes all the stretches hold together."""
        return (self.hi - self.lo) * len(self.starts)

    def views(self) -> list[memoryview]:
        """The stretches as views of the planes' memory, in order (for reads that take buffers one by one)."""
        return [v for base in self.starts for v in self.planes._views_at(base, self.lo, self.hi)]

    def piece(self, offset: int, conversion: "_Conversion | None", first: int) -> tuple[int, ...]:
        """The ``struct chatkv_piece`` fields of the piece that fills these
        stretches from the file at ``offset``: as they are or, with
        ``conversion``, converted, rows ``first`` on of its tensor.

        Raises:
            ValueError: a stretch of partial rows (with a conversion), or too few scales or offsets.
        """
        planes = self.planes
        if not self.nbytes:  # (no stretches to walk)
            return (planes._address, 0, offset, 0, 0, 0, 0, 0, 0, 0, *_NOT_STRETCHED)
        if conversion is None:
            head: tuple[int, ...] = (planes._address, self.nbytes, offset, 0, 0, 0, 0, 0, 0, 0)
            stretched = self.stretch(0, "")
        else:
            c = conversion.convert
            stretched = self.stretch(c.row * conversion.target_size if first >= 0 else -1, f"{c.row} {c.target}")
            head = conversion.piece(planes._address, self.nbytes, offset, first)
        return (*head, *stretched)

    def stretch(self, unit: int, rows: str) -> tuple[int, ...]:
        """The last seven ``struct chatkv_piece`` fields of a piece that fills
        these stretches (the C function walks them from these), after checking,
        where ``unit`` is not 0, that each stretch is whole rows of ``unit``
        bytes (``rows`` says of what, for the error).

        Raises:
            ValueError: a stretch of partial rows (or ``unit`` below 0).
        """
        planes = self.planes
        if unit and (unit < 0 or self.lo % unit or self.hi % unit or not planes.whole_rows(unit)):
            raise ValueError(f"a span is not whole rows of {rows}")
        return (self.starts.buffer_info()[0], 0, len(self.starts), planes._table.buffer_info()[0],
                len(planes.runs), self.lo, self.hi)


def bytes_address(data: bytes) -> int:
    """The address of ``data``'s bytes (valid while it lives)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


#: The destinations made of many stretches of one buffer.
STRETCHES = (Spans, PlaneSpans)


def nbytes_of(buf: Any) -> int:
    """The bytes a destination holds: a buffer's, or the :attr:`Spans.nbytes`
    (:attr:`PlaneSpans.nbytes`) of stretches."""
    return buf.nbytes if isinstance(buf, STRETCHES) else memoryview(buf).nbytes


#: long longs in the C source's ``struct chatkv_piece``: addr, len, off,
#: conv, row, scale, zero, block, phase, group, spans, sizes, count, runs,
#: nruns, lo, hi.
_PIECE_FIELDS = 17


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
        self._read = lib.chatkv_read_digest
        self._read.restype = ll
        self._read.argtypes = [ctypes.c_int, ll, ctypes.c_void_p, ll, ctypes.c_void_p, ctypes.c_void_p]
        # The state's make, reset, update, digest and free, called by the C
        # function itself: one call through ctypes a chunk, not five (each
        # gives the GIL away and waits for it back while the other reader
        # holds it). The dispatching update (AVX2/AVX-512 where the CPU has
        # them), as xxhash's Python objects use: the plain symbol is its SSE2
        # build, slower than them.
        names = ("XXH3_createState", "XXH3_128bits_reset", "XXH3_128bits_update_dispatch",
                 "XXH3_128bits_digest", "XXH3_freeState")
        self._functions = (ctypes.c_void_p * len(names))(
            *(ctypes.cast(getattr(xx, name), ctypes.c_void_p).value for name in names))
        self._libraries = (lib, xx)  # kept loaded

    def read_hashed(self, fd: int, pieces: Sequence[tuple[Any, ...]], slice_bytes: int) -> str:
        """Fill and hash ``pieces`` in order, in one call that releases the GIL:
        each ``(buffer, offset)`` with ``offset >= 0`` is filled from ``fd`` at
        that offset (a writable buffer, C-contiguous), ``slice_bytes`` per
        ``pread``, each slice hashed as it lands; one with ``offset < 0`` (any
        buffer, ``bytes`` included) is only hashed. A ``(buffer, offset,
        convert, first)`` piece (:class:`Convert`) reads the elements that
        fill ``buffer`` once converted, rows ``first`` on of the tensor
        ``convert`` describes: each slice of whole rows is read into memory
        of the call's own, hashed there, and converted into ``buffer``.
        In either form the buffer may be :class:`Spans` (filled stretch by
        stretch, the same as a piece per stretch; never only hashed). A
        ``(buffer, offset, None)`` piece (a plain buffer) is filled from
        ``fd`` and not hashed: a later piece that only hashes it does, in its
        turn (what a conversion's scales need: read before its codes, hashed
        after them).
        Returns xxh3-128's hex digest of all the bytes read or hashed, in
        order, as ``xxhash.xxh3_128().hexdigest()`` gives.

        Raises:
            EOFError: the file ends before the pieces do (what landed is unverified).
            OSError: a read failed.
            TypeError: a piece to be filled is read-only (nothing was read).
            ValueError: a piece is not C-contiguous, a span lies outside its
                buffer, a conversion does not fit its piece (unknown types,
                not whole rows, too few scales or offsets), or a piece read
                and not hashed has no offset or is Spans; nothing was read.
        """
        fields: list[int] = []  # the struct chatkv_piece array, field by field
        pinned: list[Any] = []  # the buffers' exports (and the Spans' arrays), alive until the call returns
        conversions: dict[int, _Conversion] = {}
        # The bytes objects only hashed (a chunk's tensor headers, its token ids), in one
        # buffer whose address is taken once: taking each one's costs more than joining them.
        joined = [buf for buf, offset, *_ in pieces if offset < 0 and type(buf) is bytes]
        blob = b"".join(joined)
        at = self._address(blob, pinned, filled=False)[0]

        def conversion_of(convert: Convert) -> _Conversion:
            conversion = conversions.get(id(convert))
            if conversion is None:
                conversion = conversions[id(convert)] = _Conversion(convert, self._address, pinned)
            return conversion

        for buf, offset, *more in pieces:
            if more == [None]:  # read, not hashed
                if offset < 0 or isinstance(buf, Spans):
                    raise ValueError("a piece read and not hashed needs an offset and a plain buffer")
                address, size = self._address(buf, pinned, filled=True)
                if size:
                    fields += (address, size, offset, -1, 0, 0, 0, 0, 0, 0, *_NOT_STRETCHED)
                continue
            if isinstance(buf, STRETCHES):
                if offset < 0:
                    raise ValueError("spans are read into, not only hashed")
                conversion, first = (conversion_of(more[0]), more[1]) if more else (None, 0)
                if isinstance(buf, PlaneSpans):
                    fields += buf.piece(offset, conversion, first)
                else:
                    address = self._address(buf.check(), pinned, filled=True)[0]
                    fields += _span_piece(buf, address, offset, conversion, first, pinned)
                continue
            if offset < 0 and type(buf) is bytes:
                address, size = at, len(buf)
                at += size
            else:
                address, size = self._address(buf, pinned, filled=offset >= 0)
            if not size:
                continue
            if more and offset >= 0:
                convert, first = more
                fields += conversion_of(convert).piece(address, size, offset, first)
            else:
                fields += (address, size, offset, 0, 0, 0, 0, 0, 0, 0)
            fields += _NOT_STRETCHED
        return self.read_fields(fd, array.array("q", fields), slice_bytes)  # (faster than a ctypes array)

    def read_fields(self, fd: int, fields: array.array, slice_bytes: int) -> str:
        """:meth:`read_hashed` of pieces already laid out as ``struct
        chatkv_piece`` fields (int64s, :data:`_PIECE_FIELDS` a piece: what
        :meth:`read_hashed` builds, or :meth:`PieceTemplate.fields`); the
        caller keeps every address in them valid until this returns.

        Raises:
            EOFError, OSError: as :meth:`read_hashed`.
        """
        count = len(fields) // _PIECE_FIELDS
        address = fields.buffer_info()[0]
        digest = (ctypes.c_uint64 * 2)()
        got = self._read(fd, count, address, slice_bytes, self._functions, digest)
        if got == _SHORT_READ:
            raise EOFError("the file ends before the pieces do")
        if got < 0:
            raise OSError(-got, os.strerror(-got))
        return f"{digest[1]:016x}{digest[0]:016x}"

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
            return bytes_address(data), size
        export = ctypes.c_char.from_buffer(view.cast("B"))
        pinned.append(export)
        return ctypes.addressof(export), size


class _Conversion:
    """A :class:`Convert` checked once, for each of its pieces."""

    def __init__(self, convert: Convert, address: Any, pinned: list[Any]) -> None:
        """Check ``convert`` and take its parameters' addresses (``address``:
        :meth:`NativeReads._address`, the exports kept in ``pinned``).

        Raises:
            ValueError: unknown types, rows of partial bytes, or a ``uint4x2``
                conversion without its scales, offsets and block or group.
        """
        if convert.source not in SOURCE_TYPES or convert.target not in TARGET_TYPES:
            raise ValueError(f"no conversion from {convert.source!r} to {convert.target!r}")
        source, self.source_bits = SOURCE_TYPES[convert.source]
        target, self.target_size = TARGET_TYPES[convert.target]
        row = convert.row
        if row < 1 or row * self.source_bits % 8:
            raise ValueError(f"rows of {row} {convert.source} are not whole bytes")
        self.code, self.convert = source * 16 + target, convert
        nibbles = convert.source == "uint4x2"
        if not nibbles and (convert.zero is not None or convert.block or convert.group):
            raise ValueError(f"{convert.source} codes have no offsets, blocks or groups")
        if nibbles and ((convert.block > 0) == (convert.group > 0) or convert.scale is None
                        or convert.zero is None or (convert.group and row % convert.group)):
            raise ValueError("uint4x2 codes need scales, offsets and either a block or whole groups")
        self.scale = self.zero = (0, 0)
        for name in ("scale", "zero"):
            buf = getattr(convert, name)
            if buf is not None:
                view = memoryview(buf)
                setattr(self, name, (address(buf, pinned, filled=not view.readonly)[0], view.nbytes))

    def piece(self, address: int, size: int, offset: int, first: int) -> tuple[int, ...]:
        """The ``struct chatkv_piece`` fields of a piece converted so: its
        destination (``address``, ``size`` bytes) receives rows ``first`` on
        of the tensor, read from ``offset``.

        Raises:
            ValueError: a destination of partial rows, or too few scales or
                offsets for its rows.
        """
        c = self.convert
        row = c.row
        if first < 0 or size % (row * self.target_size):
            raise ValueError(f"a piece of {size} bytes is not whole rows of {row} {c.target}")
        rows = size // (row * self.target_size)
        block = phase = group = 0
        if c.block:  # a row of float16 parameters per block, from the first row's
            start, end = 2 * (first // c.block) * row, 2 * ((first + rows - 1) // c.block + 1) * row
            block, phase = c.block, first % c.block
        elif c.group:  # row // group float16 parameters a row
            start, end = 2 * first * (row // c.group), 2 * (first + rows) * (row // c.group)
            group = c.group
        else:  # a float32 scale a row
            start, end = 4 * first, 4 * (first + rows)
        at = {}
        for name in ("scale", "zero"):
            base, nbytes = getattr(self, name)
            if base and end > nbytes:
                raise ValueError(f"{nbytes} bytes of {name}s where rows {first} to {first + rows} need {end}")
            at[name] = base + start if base else 0
        return (address, rows * row * self.source_bits // 8, offset, self.code, row, at["scale"], at["zero"],
                block, phase, group)


def _span_piece(spans: Spans, address: int, offset: int, conversion: _Conversion | None, first: int,
                pinned: list[Any]) -> tuple[int, ...]:
    """The ``struct chatkv_piece`` fields of one piece that fills ``spans``
    (its buffer at ``address``; :meth:`Spans.check` passed) stretch by
    stretch from the file at ``offset``: as they are or, with
    ``conversion``, converted, rows ``first`` on of its tensor (as
    :meth:`_Conversion.piece` gives them for a buffer of the same bytes; the
    C function moves on to the next stretch where one is full). Its int64
    arrays of offsets and sizes are kept in ``pinned``.

    Raises:
        ValueError: a stretch of partial rows, or too few scales or offsets.
    """
    import numpy as np

    offsets = np.ascontiguousarray(spans.offsets, dtype=np.int64)
    sizes = np.ascontiguousarray(spans.sizes, dtype=np.int64)
    pinned += (offsets, sizes)
    total = int(sizes.sum())
    if conversion is None:
        head: tuple[int, ...] = (address, total, offset, 0, 0, 0, 0, 0, 0, 0)
    else:
        c = conversion.convert
        if first < 0 or (sizes % (c.row * conversion.target_size)).any():
            raise ValueError(f"a span is not whole rows of {c.row} {c.target}")
        head = conversion.piece(address, total, offset, first)
    return (*head, offsets.ctypes.data, sizes.ctypes.data, len(sizes), 0, 0, 0, 0)


#: The last fields of a ``struct chatkv_piece`` that fills one buffer from its start.
_NOT_STRETCHED = (0,) * 7


class PieceTemplate:
    """The pieces of a :meth:`NativeReads.read_fields` call whose layout
    repeats (a restore's full compact chunks: the same tensors, headers and
    conversions each time), worked out and checked once. What changes from
    call to call is filled in by :meth:`fields`: where the file's data
    section starts (``base``), the addresses of two buffers of the call's
    own (``scratch``, which receives tensors read into memory, and
    ``blob``, bytes that are only hashed) and the destinations, each a
    :class:`PlaneSpans`. A restore's compact chunk (SmolLM2, 256 tokens)
    took 0.13 ms of Python in a hot loop with its pieces built afresh, 0.08
    with them filled in so (an exact chunk, one piece, 0.06).

    Made empty; each ``add_*`` appends a piece, in the order the call
    reads and hashes them. Offsets and addresses given to them are relative
    to ``base``, ``scratch`` and ``blob``.
    """

    def __init__(self) -> None:
        """An empty template."""
        self._fields: list[int] = []
        self._plus_base: list[int] = []  # positions of fields that get the call's base added
        self._plus_scratch: list[int] = []
        self._plus_blob: list[int] = []
        self._dests: list[tuple[int, int, int, str]] = []  # (first field, destination, row bytes, rows) a piece

    def add_hashed(self, at: int, size: int, *, in_blob: bool) -> None:
        """Hash ``size`` bytes at ``at`` of the blob (``in_blob``) or the
        scratch (one piece with the last where they follow on from its bytes:
        the hash is the same however its input is split)."""
        plus = self._plus_blob if in_blob else self._plus_scratch
        last = len(self._fields) - _PIECE_FIELDS
        if plus and plus[-1] == last >= 0 and self._fields[last + 2] == -1 \
                and self._fields[last] + self._fields[last + 1] == at:
            self._fields[last + 1] += size
            return
        self._add(at, size, -1, 0, in_blob=in_blob)

    def add_read(self, at: int, size: int, offset: int, *, hashed: bool) -> None:
        """Read ``size`` bytes of the file at ``offset`` (from the base) into
        the scratch at ``at``, hashed as they land or (not ``hashed``) left for
        a later :meth:`add_hashed` to hash."""
        self._add(at, size, offset, 0 if hashed else -1)

    def add_into(self, dest: int, size: int, offset: int, convert: Convert | None = None,
                 scratch: int = 0) -> None:
        """Fill destination ``dest`` (the index of its :class:`PlaneSpans` in
        the list :meth:`fields` takes; ``size`` bytes, which every call's
        holds) from the file at ``offset``, as it is or converted as
        ``convert`` says, its rows from the tensor's first: its scales and
        offsets, if any, are in the scratch, at their buffers' addresses less
        ``scratch`` (where the scratch was for the call that made the
        template).

        Raises:
            ValueError: as :meth:`NativeReads.read_hashed` for such a piece.
        """
        at = len(self._fields)
        unit, rows = 0, ""
        if convert is None:
            self._fields += (0, size, offset, 0, 0, 0, 0, 0, 0, 0)
        else:
            conversion = _Conversion(convert, NativeReads._address, [])
            head = list(conversion.piece(0, size, offset, 0))
            for i in (5, 6):  # the scale and offset addresses
                if head[i]:
                    head[i] -= scratch
                    self._plus_scratch.append(at + i)
            self._fields += head
            c = conversion.convert
            unit, rows = c.row * conversion.target_size, f"{c.row} {c.target}"
        self._fields += _NOT_STRETCHED
        self._plus_base.append(at + 2)
        self._dests.append((at, dest, unit, rows))

    def _add(self, at: int, size: int, offset: int, conv: int, *, in_blob: bool = False) -> None:
        """Append a piece of ``size`` bytes at ``at`` of the blob or the scratch."""
        first = len(self._fields)
        self._fields += (at, size, offset, conv, 0, 0, 0, 0, 0, 0, *_NOT_STRETCHED)
        (self._plus_blob if in_blob else self._plus_scratch).append(first)
        if offset >= 0:
            self._plus_base.append(first + 2)

    def fields(self, base: int, scratch: int, blob: int, dests: Sequence[PlaneSpans]) -> array.array:
        """The pieces' fields for one call: the file's data section at
        ``base``, the scratch and the blob at those addresses (the caller
        keeps them alive, with at least the bytes the pieces name), the
        destinations ``dests`` (each holding the bytes its pieces were made
        with; checked here for whole rows where converted).

        Raises:
            ValueError: a destination converted into is not whole rows.
        """
        f = self._fields.copy()
        for i in self._plus_base:
            f[i] += base
        for i in self._plus_scratch:
            f[i] += scratch
        for i in self._plus_blob:
            f[i] += blob
        for at, dest, unit, rows in self._dests:
            spans = dests[dest]
            f[at] = spans.planes._address
            f[at + 10: at + _PIECE_FIELDS] = spans.stretch(unit, rows)
        return array.array("q", f)


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


#: Libraries of other sources or compilers (older chatkv versions) unused
#: this long are removed when a new one is built.
STALE_LIBRARY_SECONDS = 30 * 86400


def _build(compiler: list[str]) -> Path:
    """The built library: found in the cache, else compiled into it
    (atomically; where the compiler refuses the per-CPU builds of the
    conversions, once more without them). A library found is touched, so
    that its last use shows in its time, and building a new one removes the
    cache's libraries unused for :data:`STALE_LIBRARY_SECONDS`.

    Raises:
        OSError: compiling failed (its message included).
    """
    flags = ["-O3", "-ffp-contract=off", "-shared", "-fPIC"]  # no fused multiply-adds: torch's rounding
    tag = hashlib.sha256("\0".join([_SOURCE, *compiler, *flags, platform.machine()]).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    library = out_dir / f"readhash-{tag}.so"
    if library.is_file():
        try:
            os.utime(library)
        except OSError:  # a read-only cache still serves
            pass
        return library
    with tempfile.TemporaryDirectory(prefix="build-", dir=out_dir) as tmp:
        source = Path(tmp) / "readhash.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / library.name
        for extra in ([], ["-DCHATKV_NO_CLONES"]):
            done = subprocess.run([*compiler, *flags, *extra, "-o", str(built), str(source)],
                                  capture_output=True, text=True, timeout=120, check=False)
            if done.returncode == 0 and built.is_file():
                break
            log.info("compiling the native reads with %s failed: %s", extra or "per-CPU builds",
                     (done.stderr or done.stdout)[-300:])
        else:
            raise OSError(errno.ENOEXEC, f"compiling the native reads failed: {(done.stderr or done.stdout)[-500:]}")
        os.replace(built, library)  # another process may have put the same file there: same bytes
    _remove_stale(out_dir, keep=library)
    return library


def _remove_stale(out_dir: Path, keep: Path) -> None:
    """Remove the libraries in ``out_dir`` but ``keep`` unused for
    :data:`STALE_LIBRARY_SECONDS` (a process that has one loaded keeps it
    mapped); failures are logged."""
    import time

    cutoff = time.time() - STALE_LIBRARY_SECONDS
    for old in out_dir.glob("readhash-*.so"):
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
                log.debug("removed the unused native reads library %s", old)
        except OSError as exc:
            log.warning("could not remove the unused native reads library %s: %s", old, exc)


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
        early = bytearray(1000)  # read first, not hashed, then hashed from memory after another piece
        later = reads.read_hashed(f.fileno(), [(early, 13 + 5, None), (b"between", -1), (early, -1)], 100_000)
        try:
            reads.read_hashed(f.fileno(), [(bytearray(10), 13 + 300_000)], 100_000)
            return "a read past the end of the probe file was not reported"
        except EOFError:
            pass
    if b"".join(targets) != payload or bytes(early) != payload[5:1005]:
        return "the probe file's bytes read differently"
    if later != xxhash.xxh3_128(b"between" + payload[5:1005]).hexdigest():
        return "a piece read and not hashed changed the digest"
    expected = xxhash.xxh3_128(header + payload + b"tail").hexdigest()
    if digest != expected:
        return f"digest {digest} where xxhash gives {expected}"
    return _self_test_conversions(reads)


def _self_test_conversions(reads: NativeReads) -> str | None:
    """Convert probe rows of every source type into every target type; None
    when every value and the digest agree with the same arithmetic done here
    (float32 products rounded by ``struct``, bfloat16 rounded to nearest even),
    else what differs."""
    import random

    import xxhash

    rng = random.Random(7)
    row = 37  # (a run of 32, which CPUs with AVX-512 BF16 convert at once, and 5 more)
    scales = [struct.unpack("<f", struct.pack("<f", x))[0]  # float32 values, as the C code reads them
              for x in (0.0, 1.0, 3.0517578125e-05, 0.0123456, 7.5, 1e-30, 1e-40)]
    numbers = [c for c in range(256) if c & 0x7F != 0x7F]
    codes: dict[str, list[int]] = {  # the bit patterns in the file (no NaN)
        "int8": [rng.randrange(256) for _ in range(row * len(scales))],
        "float8_e4m3fn": (numbers * 2)[: row * len(scales)],
        "float16": [rng.choice([rng.randrange(0x7C00), 0x8000 | rng.randrange(0x7C00), 0x7C00, 1, 0x8001])
                    for _ in range(row * len(scales))],
        "bfloat16": [rng.randrange(0x7F80) | rng.choice([0, 0x8000]) for _ in range(row * len(scales))],
        "float32": [_f32_bits(rng.uniform(-1e4, 1e4)) for _ in range(row * len(scales))],
    }
    scale_bytes = struct.pack(f"<{len(scales)}f", *scales)
    for source, bits in codes.items():
        size = SOURCE_TYPES[source][1] // 8
        data = b"".join(b.to_bytes(size, "little") for b in bits)
        scaled = source in ("int8", "float8_e4m3fn")
        values = [_decoded(source, b) * (scales[i // row] if scaled else 1.0) for i, b in enumerate(bits)]
        for target, (_, target_size) in TARGET_TYPES.items():
            out = bytearray(len(bits) * target_size)
            with tempfile.TemporaryFile() as f:
                f.write(b"pad" + data)
                f.flush()
                convert = Convert(source, target, row, bytearray(scale_bytes) if scaled else None)
                digest = reads.read_hashed(f.fileno(), [(out, 3, convert, 0)], 2 * row * size)
            if digest != xxhash.xxh3_128(data).hexdigest():
                return f"the digest of {source} read to convert differs"
            got = [int.from_bytes(out[i: i + target_size], "little") for i in range(0, len(out), target_size)]
            want = [_f32_bits(v) if target == "float32" else _bf16_bits(v) for v in values]
            if got != want:
                return f"{source} converted to {target} differs"
    return _self_test_int4(reads, rng)


def _self_test_int4(reads: NativeReads, rng: Any) -> str | None:
    """As :func:`_self_test_conversions`, for ``uint4x2`` codes: 6 rows of 64,
    parameters per element over blocks of 4 rows (the piece 3 rows into its
    first block), then per group of 4 elements of each row, then of 32 (as
    CPUs with AVX-512 BF16 convert them)."""
    row, n = 64, 6
    data = bytes(rng.randrange(256) for _ in range(n * row // 2))
    codes = [(b >> shift) & 15 for b in data for shift in (0, 4)]
    half = [struct.unpack("<e", struct.pack("<e", rng.uniform(-2, 2)))[0] for _ in range(6 * row)]
    half_bytes = struct.pack(f"<{len(half)}e", *half)
    layouts = [("block", 4, lambda r, j: ((3 + r) // 4) * row + j)]
    layouts += [("group", g, lambda r, j, g=g: r * (row // g) + j // g) for g in (4, 32)]
    for layout, size, where in layouts:
        values = []
        for i, c in enumerate(codes):
            at = where(i // row, i % row)
            values.append(_f32(_f32(c * half[at]) + half[len(half) // 2 + at]))
        scale, zero = bytearray(half_bytes[: len(half_bytes) // 2]), bytearray(half_bytes[len(half_bytes) // 2:])
        options, first = ({"block": size}, 3) if layout == "block" else ({"group": size}, 0)
        for target, (_, target_size) in TARGET_TYPES.items():
            out = bytearray(n * row * target_size)
            with tempfile.TemporaryFile() as f:
                f.write(data)
                f.flush()
                reads.read_hashed(f.fileno(), [(out, 0, Convert("uint4x2", target, row, scale, zero, **options),
                                                first)], 9)
            got = [int.from_bytes(out[i: i + target_size], "little") for i in range(0, len(out), target_size)]
            if got != [_f32_bits(v) if target == "float32" else _bf16_bits(v) for v in values]:
                return f"uint4x2 codes per {layout} of {size} converted to {target} differ"
    return None


def _f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _f32_bits(x: float) -> int:
    """The bits of ``x`` rounded to float32 (to nearest even)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _bf16_bits(x: float) -> int:
    """The bits of ``x`` rounded to float32, then to bfloat16 (to nearest even)."""
    b = _f32_bits(x)
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


def _decoded(source: str, bits: int) -> float:
    """The value of one element of ``source`` type with these bits (no NaN)."""
    if source == "int8":
        return float(bits - 256 if bits > 127 else bits)
    if source == "float16":
        return struct.unpack("<e", bits.to_bytes(2, "little"))[0]
    if source == "bfloat16":
        return struct.unpack("<f", (bits << 16).to_bytes(4, "little"))[0]
    if source == "float32":
        return struct.unpack("<f", bits.to_bytes(4, "little"))[0]
    sign, e, m = -1.0 if bits & 0x80 else 1.0, (bits >> 3) & 15, bits & 7  # float8 e4m3fn
    return sign * (m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
