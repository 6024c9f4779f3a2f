"""The portable attention backend: gather each sequence's blocks, then SDPA.

It runs on any device PyTorch supports and is the reference every other
backend is tested against.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from chatkv.attention.base import AttentionBackend, AttentionMetadata
from chatkv.errors import ConfigError


#: Prefills of at most this many tokens per sequence attend with each KV head's
#: query heads stacked as rows (faster on the CPU below about 32 tokens, level above).
GROUPED_QUERY_MAX = 32

#: Environment variable for :attr:`chatkv.config.EngineConfig.cpu_attention`:
#: ``sdpa`` keeps every step on SDPA; ``auto`` (the default) attends bfloat16
#: on the CPU by two products (:func:`product_attention`) from
#: :data:`PRODUCTS_FROM_POSITION` on.
CPU_ATTENTION_ENV = "CHATKV_CPU_ATTENTION"
#: Most scores (elements) one product computes; longer prefills are cut into row chunks.
PRODUCTS_MAX_SCORES = 1 << 23
#: Rows at this position and later attend by products; earlier ones through
#: SDPA, whose one call costs less than the products' few below about 1k keys
#: (a whole decode step over 500 keys: 1.04x as long by products, over 1k
#: 1.07x, over 1.5k 0.91x; a returning turn's prefill gains from 500 on).
PRODUCTS_FROM_POSITION = 1024
#: Scores (elements) per softmax call in :func:`product_attention`: a
#: chunk's float32 softmax goes a tile of rows at a time (2 MB of float32),
#: so that its copies stay in the CPU's cache. On this project's AMD VM a
#: chunk's softmax of 8M scores took 3.8 ms this way against 5.6 in one
#: call (level below about a million), and a whole compiled prefill step of
#: 299 tokens over 4k 0.89x the time, of 94 over 6k 0.87x.
SOFTMAX_TILE_SCORES = 1 << 19
#: Up to this many query rows per KV head, scores are computed as ``k @ q^T``
#: (faster with few rows: oneDNN packs the small operand), above as ``q @ k^T``
#: one KV head at a time (:func:`_queries_first`). Whole SmolLM2 prefill steps
#: alternating between the two (bf16, this project's AMD VM): keys first 0.93x
#: to 0.99x the time at 2 and 4 tokens (6 and 12 rows), level to 1.21x at 8
#: (24 rows), 1.07x to 1.20x at 21 tokens over 1.9k and 4.3k keys.
KEYS_FIRST_MAX_ROWS = 18


def resolve_cpu_attention(setting: str | None) -> str:
    """``"auto"`` or ``"sdpa"`` for ``setting`` (None: ``$CHATKV_CPU_ATTENTION``, else auto).

    Raises:
        ConfigError: anything else.
    """
    if setting is None:
        setting = os.environ.get(CPU_ATTENTION_ENV, "") or "auto"
    mode = setting.strip().lower()
    if mode not in ("auto", "sdpa"):
        raise ConfigError(f"cpu_attention (or ${CPU_ATTENTION_ENV}) must be 'auto' or 'sdpa', got {setting!r}")
    return mode


def products_apply(query: torch.Tensor) -> bool:
    """Whether a step's ``query`` may attend by :func:`product_attention` in a
    backend that allows it: bfloat16 on the CPU. Its rows from
    :data:`PRODUCTS_FROM_POSITION` on then do; earlier rows go through SDPA.

    Where the CPU has no bfloat16 GEMM of MKL's own (this project's AMD VM),
    SDPA's flash kernel widens bfloat16 tiles to float32 for MKL's sgemm, and
    each 32-row tile of queries costs a fixed share; oneDNN's bfloat16
    products (``brg_matmul``) run a chat turn's new message over 1k to 4k
    keys in about half SDPA's time. A decode step costs the products about
    six operator calls against SDPA's one: the whole step over 500 keys
    1.04x SDPA's time, about level at 1k, less beyond
    (``python -m benchmarks.attention_paths``). Which way
    a row attends depends on its position alone, never on the step it is in
    (a turn prefilled in one step or in several, or decoded), and the
    products' rows do not depend on the step at all (tested bit for bit).
    """
    return query.dtype is torch.bfloat16 and query.device.type == "cpu"


def product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None,
    masks: dict | None = None, out: torch.Tensor | None = None,
    whole_blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[kv_heads, group, T, D]`` (the last ``T``
    positions) over ``k``/``v`` ``[kv_heads, L, D]`` as two matrix products.

    The arithmetic is transformers' eager attention in the query's dtype:
    scores ``q @ k^T`` rounded to that dtype and scaled, the mask added,
    softmax in float32 rounded back, then ``@ v``. A power-of-two ``scale``
    (head dimension 64, 256, ...) is applied to the queries instead, which
    gives the same scores bit for bit. Each KV head's query heads are stacked
    as rows (no repeated keys). With few rows (:data:`KEYS_FIRST_MAX_ROWS`:
    a message of a few tokens) the scores are computed as ``k @ q^T`` and
    read transposed: oneDNN then packs the small operand, not the keys;
    with more, as ``q @ k^T`` one KV head at a time (:func:`_queries_first`);
    the values are the same either way (tested). Rows are cut into chunks of
    at most :data:`PRODUCTS_MAX_SCORES` scores, and a chunk multiplies only
    up to the last key its rows may see; keys past a row's position only add
    zeros, so a row's result does not depend on the step it is in. ``masks``
    is where the step keeps its masks and its layers' scratch buffers
    (:func:`step_mask`, :func:`_scratch`). A decode step's one row (no
    window) over keys and values that are rows of the pool takes a path of
    its own (:func:`_product_decode`, which ``whole_blocks`` serves). The
    result is written into ``out`` when given (``q``'s shape, any strides: a
    view of the step's output).

    Returns:
        ``[kv_heads, group, T, D]`` (``out`` when given).
    """
    kv_heads, group, q_len, head_dim = q.shape
    kv_len = k.shape[1]
    if q_len == 1 and sliding_window is None:
        done = _product_decode(q, k, v, scale, masks, out, whole_blocks)
        if done is not None:
            return done
    offset = kv_len - q_len  # position of the first query
    if out is None:
        out = q.new_empty(q.shape)
    rows = max(1, min(q_len, PRODUCTS_MAX_SCORES // max(1, kv_heads * group * kv_len)))
    for t0 in range(0, q_len, rows):
        t1 = min(q_len, t0 + rows)
        n = t1 - t0
        last = offset + t1  # keys after the chunk's last query are hidden from every row
        qc = _scratch(masks, "queries", (kv_heads, group, n, head_dim), q)  # the chunk's rows of its own
        rescale = _queries_into(qc, q[:, :, t0:t1], scale)
        qc = qc.view(kv_heads, group * n, head_dim)
        if group * n <= KEYS_FIRST_MAX_ROWS:  # the same values either way
            scores = torch.matmul(k[:, :last], qc.transpose(1, 2)).transpose(1, 2)
        else:  # [kv_heads, group*n, last]
            scores = _queries_first(qc, k, last, _scratch(masks, "scores", (kv_heads, group * n, last), q))
        if rescale:
            scores = scores * scale
        # The chunk's rows are the last n of `last` positions: the step's shared
        # additive mask (0 or -inf; adding 0 leaves a score as it is, as eager's does).
        mask = step_mask(masks, n, last, sliding_window, q.device, q.dtype)
        if mask is not None:
            # Without a window only the keys from the chunk's first query on can be hidden.
            lo = 0 if sliding_window is not None else offset + t0
            scores.view(kv_heads, group, n, last)[..., lo:].add_(mask[:, lo:])
        probs = _softmax_rounded(scores, masks)
        out[:, :, t0:t1] = torch.matmul(probs, v[:, :last]).view(kv_heads, group, n, head_dim)
    return out


def _softmax_rounded(scores: torch.Tensor, masks: dict | None = None) -> torch.Tensor:
    """Softmax of ``scores`` over its last dimension in float32, rounded back
    to ``scores``' dtype, as transformers' eager attention computes it (a
    bfloat16 softmax is not always the same, and on a transposed input
    differs more often).

    A contiguous ``scores`` of more than :data:`SOFTMAX_TILE_SCORES`
    elements is overwritten with the result (and returned), a tile of whole
    rows at a time through two float32 buffers of a tile each (kept in
    ``masks`` for the step's other layers, :func:`_scratch`): the tile's
    widened copy and its softmax then stay in the CPU's cache, where a whole
    chunk's (32 MB each at 8M scores) went through memory. Each row's values
    are the same either way (the kernel works row by row; tested bit for
    bit)."""
    last = scores.shape[-1]
    if scores.numel() <= SOFTMAX_TILE_SCORES or not scores.is_contiguous():
        return torch.softmax(scores, -1, dtype=torch.float32).to(scores.dtype)
    rows = scores.view(-1, last)
    step = max(1, SOFTMAX_TILE_SCORES // last)
    wide = _scratch(masks, "softmax", (2, step, last), scores, torch.float32)
    for a in range(0, rows.shape[0], step):
        tile = rows[a: a + step]
        n = tile.shape[0]
        widened, probs = wide[0, :n], wide[1, :n]
        widened.copy_(tile)
        torch.softmax(widened, -1, out=probs)
        tile.copy_(probs)
    return scores


def _queries_into(into: torch.Tensor, q: torch.Tensor, scale: float) -> bool:
    """Copy the queries ``q`` into ``into``, scaled in the same pass where
    ``scale`` is a power of two (scaling the queries then gives the scores
    scaling them would, bit for bit). Returns whether the scores still need
    multiplying by ``scale`` (any other scale, as transformers' eager
    attention applies it)."""
    if math.frexp(scale)[0] == 0.5:
        torch.mul(q, scale, out=into)
        return False
    into.copy_(q)
    return True


def _queries_first(qc: torch.Tensor, k: torch.Tensor, last: int, scores: torch.Tensor) -> torch.Tensor:
    """``qc @ k[:, :last]^T`` (``[kv_heads, rows, D]`` by ``[kv_heads, L, D]``)
    into ``scores`` (``[kv_heads, rows, last]``, returned): one product per KV
    head, each reading its keys transposed where they are. A batched product
    over the pool's rows (``k`` a view of them) first copies every head's
    keys transposed: about 100 µs a layer over 1.9k keys here, as long as
    the product itself. The same values bit for bit (tested)."""
    for q_h, k_h, s_h in zip(qc.unbind(0), k[:, :last].transpose(1, 2).unbind(0), scores.unbind(0)):
        torch.mm(q_h, k_h, out=s_h)
    return scores


def _scratch(masks: dict | None, name: str, shape: tuple[int, ...], like: torch.Tensor,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized buffer of ``shape``, on ``like``'s device and of its
    dtype unless ``dtype`` is given, that every layer of a step uses in turn
    (kept in ``masks``, the step's dict, as a flat buffer of the largest size
    asked for under ``name``); a new one without ``masks``. A layer's
    products then write the memory the layer before wrote, still in the
    CPU's caches, rather than memory the allocator hands back in another
    order (about 2% of a layer's attention over 1.9k keys here). Its
    contents are the caller's until it asks again."""
    numel = math.prod(shape)
    dtype = dtype or like.dtype
    if masks is None:
        return like.new_empty(shape, dtype=dtype)
    key = ("scratch", name, dtype, like.device)
    flat = masks.get(key)
    if flat is None or flat.numel() < numel:
        flat = masks[key] = like.new_empty(numel, dtype=dtype)
    return flat[:numel].view(shape)


#: Keys of the throwaway attention :func:`warm_product_buffers` runs.
WARM_PRODUCT_KEYS = 4096


def warm_product_buffers(kv_heads: int, group: int, head_dim: int, device: torch.device) -> int:
    """Run :func:`product_attention` once, on zeros, over
    :data:`WARM_PRODUCT_KEYS` keys with as many query rows as one of its
    chunks holds (:data:`PRODUCTS_MAX_SCORES` scores), in bfloat16: the
    largest buffers a long prefill's attention allocates, about 24 MB (the
    chunk's scores, the softmax's float32 tiles and the mask).
    Freed, they stay with the calling thread's allocator
    (:mod:`chatkv.allocator`), so that the first long turn of a process
    does not write fresh pages for them (about 20,000 page faults for a
    250-token turn over 3.6k tokens on this project's VM, where a fresh
    page costs about nine times a page written before). Returns the query
    rows run."""
    rows = max(1, PRODUCTS_MAX_SCORES // (kv_heads * group * WARM_PRODUCT_KEYS))
    q = torch.zeros(kv_heads, group, rows, head_dim, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(kv_heads, WARM_PRODUCT_KEYS, head_dim, dtype=torch.bfloat16, device=device)
    product_attention(q, kv, kv, head_dim ** -0.5, None)
    return rows


def _diagonal(kv_heads: int, group: int, head_dim: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Size and strides, as ``[kv_heads, group, D]``, of the blocks ``(h, h)``
    of a contiguous ``[kv_heads, group, kv_heads, D]`` tensor: each query
    head's columns of its own KV head (for :meth:`torch.Tensor.as_strided`)."""
    width = kv_heads * head_dim
    return (kv_heads, group, head_dim), (group * width + head_dim, width, 1)


def _block_diagonal_products(blocks: torch.Tensor, into: torch.Tensor, qc: torch.Tensor, rows: torch.Tensor,
                             values: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
    """The two products of one decode row per query head over every KV head
    at once, the arithmetic of :func:`product_attention`: the queries ``qc``
    ``[kv_heads, group, D]``, scaled (exactly, for a power-of-two
    ``scale``), written into ``into`` (the diagonal of ``blocks``, a
    ``[kv_heads, group, kv_heads, D]`` buffer zero elsewhere) and multiplied
    by the keys ``rows`` ``[L', kv_heads * D]`` read transposed; the scores
    of slots from ``kv_len`` on set to -inf; softmax in float32 rounded back;
    times ``values`` ``[L', kv_heads * D]``. Returns that product, ``[heads,
    kv_heads * D]``, of which each row's own head's block (:func:`_diagonal`)
    is its result."""
    kv_heads, group, _, _ = blocks.shape
    rescale = _queries_into(into, qc, scale)
    scores = torch.mm(blocks.view(kv_heads * group, -1), rows.t())  # [heads, L']
    if rescale:
        scores = scores * scale
    if rows.shape[0] > kv_len:
        scores[:, kv_len:] = float("-inf")  # slots past the row's position (whatever they hold)
    probs = _softmax_rounded(scores)
    return torch.mm(probs, values)


def _product_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    masks: dict | None, out: torch.Tensor | None,
                    whole_blocks: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """:func:`product_attention` of one row per query head over every key (a
    decode step without a window): the same products, softmax and roundings
    as the general path, so the same values bit for bit, in fewer operator
    calls (a decode step's attention is mostly their fixed cost).

    Where ``k`` and ``v`` are views of the pool's ``[L, kv_heads, D]`` rows
    (the engine's case), each product is one matrix product over all KV
    heads: the queries laid out block diagonally (``[heads, kv_heads * D]``,
    each query head's row nonzero only in its own KV head's ``D`` columns)
    times the keys ``[L, kv_heads * D]`` read transposed, and the
    probabilities ``[heads, L]`` times the values ``[L, kv_heads * D]``, of
    which each row keeps its own head's block. The zeros add nothing to a sum
    (tested bit for bit against the per-head products), and neither product
    copies the keys or values into per-head matrices first, as a batched
    product over the ``[kv_heads, L, D]`` view does. The block-diagonal
    buffer is kept in ``masks`` for the step's other layers (only its
    diagonal blocks are ever written).

    ``whole_blocks`` (the rows ``[L', kv_heads, D]`` of every block holding
    the keys and values, ``L' >= L`` a multiple of the block size) lets both
    products run over ``L'`` keys instead of ``L``: oneDNN builds a kernel
    for each new shape (about 0.7 ms per product here, more than the rest of
    a layer's attention), and a decode step's ``L`` is new every step, where
    ``L'`` changes once per block. The extra keys' scores are set to -inf, so
    their probabilities are exact zeros and every row's value is the same bit
    for bit (tested). A zero times a non-finite value is not zero, so the
    extra values (slots no token has been written to yet, holding whatever
    the pool's memory held) are checked first (:func:`_finite`); where one is
    not finite, the products run over ``L`` keys.

    Returns None, computing nothing, where ``k`` or ``v`` are not rows of
    the pool (a ``[kv_heads, L, D]`` tensor of their own): the general path
    then computes the same values.
    """
    kv_heads, group, _, head_dim = q.shape
    rows, values = k.transpose(0, 1), v.transpose(0, 1)  # [L, kv_heads, D]
    kv_len = rows.shape[0]
    if whole_blocks is not None and whole_blocks[0].shape[0] > kv_len and whole_blocks[0].is_contiguous() \
            and whole_blocks[1].is_contiguous() and _finite(whole_blocks[1][kv_len:]):
        rows, values = whole_blocks
    if not (rows.is_contiguous() and values.is_contiguous()):
        return None
    key = ("decode blocks", kv_heads, group, head_dim, q.dtype, q.device)
    blocks = masks.get(key) if masks is not None else None
    if blocks is None:
        blocks = q.new_zeros(kv_heads, group, kv_heads, head_dim)
        if masks is not None:
            masks[key] = blocks
    diagonal = _diagonal(kv_heads, group, head_dim)
    full = _block_diagonal_products(blocks, blocks.as_strided(*diagonal), q.view(kv_heads, group, head_dim),
                                    rows.view(rows.shape[0], -1), values.view(values.shape[0], -1), kv_len, scale)
    result = full.as_strided(*diagonal)  # each row's own head: [kv_heads, group, D]
    if out is None:
        return result.contiguous().view(kv_heads, group, 1, head_dim)
    out.view(kv_heads, group, head_dim).copy_(result)
    return out


class _DecodeBlocks(NamedTuple):
    """Where a decode step's one sequence lies in the pool (:func:`_decode_blocks`)."""

    #: Its block ids to gather (an int64 tensor), or None when they are consecutive.
    gather: torch.Tensor | None
    #: Its first slot in the rows attention reads: the pool's, or the gathered ones (0).
    first: int
    #: The pool's block holding its last token.
    last: int


def _decode_blocks(meta: AttentionMetadata, kv_len: int, block_size: int) -> _DecodeBlocks:
    """The decode step's sequence's :class:`_DecodeBlocks`, found once per step (``meta.extras``)."""
    found = meta.extras.get("decode blocks")
    if found is None or found[0] != kv_len:
        runs = meta.extras.get("contiguous_start")
        run = runs[0] if runs else -1
        n = -(-kv_len // block_size)
        if run >= 0:
            blocks = _DecodeBlocks(None, run * block_size, run + n - 1)
        else:
            table = meta.block_tables[0, :n].to(torch.int64)
            blocks = _DecodeBlocks(table, 0, int(table[-1]))
        found = meta.extras["decode blocks"] = (kv_len, blocks)
    return found[1]


def _product_decode_rows(meta: AttentionMetadata, query: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                         first: int, kv_len: int, last_block: int, scale: float) -> torch.Tensor:
    """:func:`_product_decode` for one decode row (``query`` ``[1, heads, 1,
    D]``) whose keys and values are the rows ``first .. first + kv_len - 1``
    of ``k_flat``/``v_flat`` (``[slots, kv_heads, D]``: one layer's pool, or
    the sequence's blocks gathered; its last token's block is the pool's
    ``last_block``): the same operators on the same views, so the same values
    bit for bit (tested), with fewer operator calls around them, as a decode
    step's attention is mostly their fixed cost. The block-diagonal query
    buffer, the views of its diagonal and of the product's, and whether the
    unwritten value slots after the row are finite in every layer (one check
    for all) are made once per step, in ``meta.extras``. ``[1, 1, heads, D]``."""
    _, heads, _, head_dim = query.shape
    kv_heads = k_flat.shape[1]
    group, width = heads // kv_heads, kv_heads * head_dim
    block_size = meta.kv.shape[3]
    whole = -(-kv_len // block_size) * block_size  # every row of the blocks holding the keys
    step = meta.extras.get("decode rows")
    if step is None or step[0] != (kv_len, query.dtype):
        blocks = query.new_zeros(kv_heads, group, kv_heads, head_dim)
        diagonal = _diagonal(kv_heads, group, head_dim)
        # The unwritten value slots after the row, every layer (a zero times them must be 0).
        finite = whole == kv_len or _finite(meta.kv[:, 1, last_block, kv_len % block_size:])
        step = meta.extras["decode rows"] = ((kv_len, query.dtype), blocks, blocks.as_strided(*diagonal),
                                             diagonal, finite)
    _, blocks, into, diagonal, finite = step
    if not finite:
        whole = kv_len  # products over the row's own keys (a shape oneDNN may build a kernel for)
    full = _block_diagonal_products(blocks, into, query.view(kv_heads, group, head_dim),
                                    k_flat.view(-1, width)[first: first + whole],
                                    v_flat.view(-1, width)[first: first + whole], kv_len, scale)
    return full.as_strided(*diagonal).reshape(1, 1, heads, head_dim)


def _finite(values: torch.Tensor) -> bool:
    """Whether every element of ``values`` is finite (a float32 sum that is; one
    that overflows says no, which only costs the caller its fast path). About
    a sixth of ``isfinite().all()``'s time on a few rows here."""
    return math.isfinite(float(torch.sum(values, dtype=torch.float32)))


def causal_window_mask(
    q_len: int, kv_len: int, sliding_window: int | None, device: torch.device,
    dtype: torch.dtype = torch.bool,
) -> torch.Tensor | None:
    """Mask ``[q_len, kv_len]`` for a chunk ending at ``kv_len``: boolean (True =
    attend), or for a float ``dtype`` additive (0 = attend, -inf = not).

    The ``q_len`` queries are the last positions ``kv_len - q_len .. kv_len - 1``
    (bottom-right aligned causal mask). Returns None when every key is visible,
    so SDPA can take its unmasked fast path.
    """
    if q_len == 1 and (sliding_window is None or kv_len <= sliding_window):
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    if dtype == torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))


def step_mask(masks: dict | None, q_len: int, kv_len: int, sliding_window: int | None,
              device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """:func:`causal_window_mask` as an additive ``dtype`` mask, made once per
    step and shape: ``masks`` (a step's ``AttentionMetadata.extras`` entry)
    keeps it for the model's other layers. SDPA adds a float mask as it is,
    where it first converts a boolean one (a tenth of a prefill's attention
    time here)."""
    key = (q_len, kv_len, sliding_window, dtype)
    if masks is not None and key in masks:
        return masks[key]
    mask = causal_window_mask(q_len, kv_len, sliding_window, device, dtype)
    if masks is not None:
        masks[key] = mask
    return mask


def _repeated_mask(masks: dict | None, mask: torch.Tensor, group: int) -> torch.Tensor:
    """``mask`` repeated ``group`` times along its rows, kept in ``masks`` for the step's other layers."""
    key = ("repeated", mask.data_ptr(), tuple(mask.shape), group)
    if masks is not None and key in masks:
        return masks[key]
    rows = mask.repeat(group, 1)
    if masks is not None:
        masks[key] = rows
    return rows


def gather_sequence_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, contiguous_start: int = -1,
    whole_blocks: bool = False,
) -> torch.Tensor:
    """Return the first ``seq_len`` rows of a sequence's blocks as ``[seq_len, kv_heads, head_dim]``
    (with ``whole_blocks``, every row of the blocks holding them: a multiple of
    the block size, the rows past ``seq_len`` as the pool has them).

    With ``contiguous_start >= 0`` the blocks are known to be consecutive from
    that block on, and the result is a view (no copy).
    """
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    if contiguous_start >= 0:
        blocks = cache[contiguous_start : contiguous_start + n_blocks]
    else:
        blocks = cache.index_select(0, block_table[:n_blocks].long())
    rows = blocks.reshape(n_blocks * block_size, *cache.shape[2:])
    return rows if whole_blocks else rows[:seq_len]


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    contiguous_start: list[int] | None = None,
    masks: dict | None = None,
    products: bool = False,
) -> torch.Tensor:
    """Paged attention for a packed batch, one sequence at a time, via SDPA
    (or, with ``products``, its rows from :data:`PRODUCTS_FROM_POSITION` on by
    :func:`product_attention` where :func:`products_apply`).

    Args:
        query: ``[T, q_heads, head_dim]``, sequences packed in order.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``.
        block_tables: ``[S, max_blocks]`` int32.
        seq_lens: context length of each sequence (cached + new).
        query_lens: new tokens of each sequence; they sum to ``T``.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: see :meth:`AttentionBackend.forward`.
        contiguous_start: per sequence, the first block when its blocks are
            consecutive in the pool (read as a view), else -1.
        masks: where the step keeps its masks between layers (see :func:`step_mask`).
        products: attend rows from :data:`PRODUCTS_FROM_POSITION` on by
            :func:`product_attention` (as transformers' eager attention
            does) where :func:`products_apply`.

    Returns:
        ``[T, q_heads, head_dim]``.
    """
    total, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    assert q_heads % kv_heads == 0, (q_heads, kv_heads)
    assert sum(query_lens) == total, (query_lens, total)
    group = q_heads // kv_heads
    out = torch.empty_like(query)
    products = products and products_apply(query)
    start = 0
    for i, (kv_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        run = contiguous_start[i] if contiguous_start is not None else -1
        k_rows = gather_sequence_kv(k_cache, block_tables[i], kv_len, run, whole_blocks=True)
        v_rows = gather_sequence_kv(v_cache, block_tables[i], kv_len, run, whole_blocks=True)
        if k_rows.dtype != query.dtype:
            k_rows, v_rows = k_rows.to(query.dtype), v_rows.to(query.dtype)
        k, v = k_rows[:kv_len].transpose(0, 1), v_rows[:kv_len].transpose(0, 1)  # [kv_heads, L, D]
        # Rows before PRODUCTS_FROM_POSITION attend through SDPA, the rest by
        # products: which way a row attends depends on its position alone.
        cut = q_len if not products else max(0, min(q_len, PRODUCTS_FROM_POSITION - (kv_len - q_len)))
        if cut:
            seen = kv_len - q_len + cut
            out[start : start + cut] = _sdpa_attention(query[start : start + cut], k[None, :, :seen],
                                                       v[None, :, :seen], scale, sliding_window, masks)
        if cut < q_len:
            n = q_len - cut
            if n == 1:  # a decode row, written in place
                product_attention(query[start + cut].view(kv_heads, group, 1, head_dim), k, v, scale,
                                  sliding_window, masks, out=out[start + cut].view(kv_heads, group, 1, head_dim),
                                  whole_blocks=(k_rows, v_rows))
            else:  # read from the step's query and written into its output where they are
                heads = (kv_heads, group)
                product_attention(query[start + cut : start + q_len].unflatten(1, heads).permute(1, 2, 0, 3), k, v,
                                  scale, sliding_window, masks,
                                  out=out[start + cut : start + q_len].unflatten(1, heads).permute(1, 2, 0, 3))
        start += q_len
    return out


def _sdpa_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    sliding_window: int | None, masks: dict | None) -> torch.Tensor:
    """One sequence's ``query`` ``[T, q_heads, D]`` (the last ``T`` of ``L``
    positions) over its keys and values ``[1, kv_heads, L, D]`` through SDPA;
    ``[T, q_heads, D]``."""
    q_len, q_heads, head_dim = query.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    if q_len == 1:
        # Decode: the query heads that share a KV head become that head's
        # queries, all at the last position, so no mask is needed (a window
        # is a slice) and SDPA sees [1, kv_heads, group, D] against
        # [1, kv_heads, L, D]: no GQA expansion, and several queries per
        # head, which CPU SDPA runs several times faster than one.
        lo = kv_len - sliding_window if sliding_window is not None and kv_len > sliding_window else 0
        q = query[0].reshape(kv_heads, group, head_dim).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k[:, :, lo:], v[:, :, lo:], scale=scale)
        return o[0].reshape(1, q_heads, head_dim)
    q = query.transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
    mask = step_mask(masks, q_len, kv_len, sliding_window, query.device, query.dtype)
    if group > 1 and q_len <= GROUPED_QUERY_MAX:
        # A short prefill (a chat turn's new message) as decode does it: each KV
        # head's group of query heads as one head of group * q_len rows, the
        # mask repeated per group; the same result, bit for bit, with no GQA
        # expansion of the keys and values (a quarter less time at 21 tokens).
        rows = _repeated_mask(masks, mask, group) if mask is not None else None
        o = F.scaled_dot_product_attention(
            q.reshape(1, kv_heads, group * q_len, head_dim), k, v,
            attn_mask=rows, scale=scale,
        ).reshape(1, q_heads, q_len, head_dim)  # CUDA's SDPA may return a strided layout
    else:
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale,
            enable_gqa=q_heads != kv_heads,
        )
    return o[0].transpose(0, 1)


class TorchBackend(AttentionBackend):
    """Reads each sequence's blocks (a view when they are consecutive) and calls
    SDPA, or in bfloat16 on the CPU multiplies for long contexts (``products``)."""

    name = "torch"

    def __init__(self, products: bool = False) -> None:
        #: Attend by :func:`product_attention` where :func:`products_apply` (bfloat16 on the CPU).
        self.products = products

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`."""
        return paged_attention_reference(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens_list,
            meta.query_lens_list, scale, sliding_window, meta.extras.get("contiguous_start"),
            meta.extras.setdefault("masks", {}), self.products,
        )

    def decode_one(
        self,
        meta: AttentionMetadata,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor | None:
        """See :meth:`AttentionBackend.decode_one`. The same operators as
        :meth:`forward` (SDPA, or :func:`product_attention`'s from
        :data:`PRODUCTS_FROM_POSITION` on) on views with the same strides, so
        the same values bit for bit (tested), in far fewer operator calls: a
        decode step is one such row per layer, and the general path's slicing,
        reshaping and copying cost about 26 µs a layer here, 0.8 ms of a 17 ms
        step. A sequence whose blocks are consecutive in the pool (the
        engine's usual case) is read where it is; any other (after an edit,
        or sharing a system prompt's blocks with another session) is first
        gathered into rows of its own, as the general path does (on the CPU).
        None for anything else: windowed products, another dtype, several
        rows (nothing written)."""
        kv = meta.kv
        runs = meta.extras.get("contiguous_start")
        scattered = not runs or runs[0] < 0
        if kv.dtype != query.dtype or key.dtype != kv.dtype or query.shape[2] != 1 \
                or (scattered and kv.device.type != "cpu"):  # (reading the table here would sync a device)
            return None
        _, _, _, block_size, kv_heads, head_dim = kv.shape
        q_heads = query.shape[1]
        group = q_heads // kv_heads
        kv_len = meta.seq_lens_list[0]
        products = self.products and kv_len - 1 >= PRODUCTS_FROM_POSITION and products_apply(query)
        if products and sliding_window is not None:
            return None  # the general path's windowed products
        k_cache, v_cache = kv[layer, 0], kv[layer, 1]
        k_flat = k_cache.view(-1, kv_heads, head_dim)
        v_flat = v_cache.view(-1, kv_heads, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, key.reshape(1, kv_heads, head_dim))
        v_flat.index_copy_(0, meta.slot_mapping, value.reshape(1, kv_heads, head_dim))
        blocks = _decode_blocks(meta, kv_len, block_size)
        if blocks.gather is not None:  # scattered: the sequence's blocks as rows of their own
            k_flat = k_cache.index_select(0, blocks.gather).view(-1, kv_heads, head_dim)
            v_flat = v_cache.index_select(0, blocks.gather).view(-1, kv_heads, head_dim)
        first = blocks.first  # the sequence's first slot in k_flat / v_flat
        if not products:  # as _sdpa_attention's decode row
            lo = kv_len - sliding_window if sliding_window is not None and kv_len > sliding_window else 0
            size, row = (1, kv_heads, kv_len - lo, head_dim), kv_heads * head_dim
            k = k_flat.as_strided(size, (row, head_dim, row, 1), k_flat.storage_offset() + (first + lo) * row)
            v = v_flat.as_strided(size, (row, head_dim, row, 1), v_flat.storage_offset() + (first + lo) * row)
            o = F.scaled_dot_product_attention(query.reshape(1, kv_heads, group, head_dim), k, v, scale=scale)
            return o.reshape(1, 1, q_heads, head_dim)
        return _product_decode_rows(meta, query, k_flat, v_flat, first, kv_len, blocks.last, scale)
