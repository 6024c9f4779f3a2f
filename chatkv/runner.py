"""The model runner: one packed forward pass over several sequences' new tokens.

Sequences of different lengths are packed along the token axis with no
padding; each token carries its absolute position, and the attention metadata
tells every layer which blocks each sequence reads. Only the last position of
each sequence goes through the vocabulary projection.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from chatkv.attention import AttentionBackend, AttentionMetadata, attach
from chatkv.block_pool import BlockPool
from chatkv.compile import DecodeGraphs, PrefillGraph
from chatkv.costs import MIN_PREFILL_TOKENS, CostModel
from chatkv.cuda_graphs import CudaDecodeGraphs
from chatkv.errors import OutOfBlocksError
from chatkv.prepack import prepack as prepack_linears
from chatkv.sequence import Sequence
from chatkv.threads import in_passing_thread


#: :meth:`ModelRunner.forward` calls of every runner in the process, in a list
#: (one element) so that runners in any thread add to it.
_FORWARDS_IN_PROCESS = [0]


def forwards_in_process() -> int:
    """How many steps the :class:`ModelRunner` objects of this process have
    started so far. A compile in one thread races with a model run eagerly in
    another, whichever engine's model it is (transformers' kernel wrappers
    keep process-wide state while Dynamo traces), so an engine compares this
    count before and after a failed compile to decide whether to try again."""
    return _FORWARDS_IN_PROCESS[0]


@dataclass
class StepInput:
    """One sequence's share of a packed step: ``tokens`` are appended after
    ``seq.num_computed``. ``tokens`` must equal ``seq.token_ids[num_computed:num_computed+len]``."""

    seq: Sequence
    tokens: list[int]


class ModelRunner:
    """Runs a transformers causal LM over the paged pool.

    The model is switched to chatkv's attention function (see
    :func:`chatkv.attention.attach`) and always called with ``use_cache=False``
    so transformers builds no cache of its own.
    """

    def __init__(self, model: Any, pool: BlockPool, backend: AttentionBackend,
                 costs: CostModel | None = None, prepack: bool = False) -> None:
        """Wrap ``model`` (attaching chatkv attention) to run over ``pool`` with
        ``backend``; prefill steps are timed into ``costs`` if given. With
        ``prepack`` the model's CPU linear layers are packed for oneDNN
        (:func:`chatkv.prepack.prepack`)."""
        attach(model)
        #: Linear layers packed for oneDNN by this runner (0: none, or packing unavailable).
        self.packed_linears = in_passing_thread(prepack_linears, model) if prepack else 0
        self.model = model
        self.pool = pool
        self.backend = backend
        self.costs = costs
        self.device = next(model.parameters()).device
        #: Compiled decode steps (:mod:`chatkv.compile`, or on CUDA the graphs of
        #: :mod:`chatkv.cuda_graphs`), once the engine has built them.
        self.decode_graphs: "DecodeGraphs | CudaDecodeGraphs | None" = None
        #: Steps run through :attr:`decode_graphs` so far.
        self.compiled_steps = 0
        #: One-sequence prefill steps compiled with a dynamic token count
        #: (:class:`chatkv.compile.PrefillGraph`), once the engine has built it.
        self.prefill_graph: PrefillGraph | None = None
        #: Steps run through :attr:`prefill_graph` so far.
        self.compiled_prefills = 0
        #: The pad rows' sequence and slot (:meth:`pad_step`), once a step needed them.
        self._pad: tuple[Sequence, int] | None = None

    def build_metadata(self, batch: list[StepInput]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """Reserve slots for every new token and pack the step.

        Returns:
            ``(meta, input_ids [1, T], position_ids [1, T])``.

        Raises:
            OutOfBlocksError: the pool cannot hold the step; slots reserved for
                earlier sequences of this batch stay reserved (their blocks are
                owned by those sequences and freed with them).
        """
        pool = self.pool
        slots: list[int] = []
        ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        for item in batch:
            seq, n = item.seq, len(item.tokens)
            assert n > 0, "a step needs at least one token per sequence"
            start = seq.num_computed
            assert seq.token_ids[start : start + n] == item.tokens, "step tokens must extend the sequence"
            slots.extend(pool.prepare_write(seq, n))
            ids.extend(item.tokens)
            positions.extend(range(start, start + n))
            seq_lens.append(start + n)
            query_lens.append(n)
        max_blocks = max(len(item.seq.block_table) for item in batch)
        table = torch.zeros((len(batch), max_blocks), dtype=torch.int32)
        for i, item in enumerate(batch):
            table[i, : len(item.seq.block_table)] = torch.tensor(item.seq.block_table, dtype=torch.int32)
        cu = torch.zeros(len(batch) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
        dev = self.device
        meta = AttentionMetadata(
            kv=pool.kv,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=table.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=cu.to(dev),
            seq_lens_list=seq_lens,
            query_lens_list=query_lens,
            max_query_len=max(query_lens),
            backend=self.backend,
        )
        # Where a sequence's blocks are consecutive in the pool (the common case for a
        # session allocated in one go), backends may read them as one slice.
        runs = []
        for item in batch:
            table = item.seq.block_table
            runs.append(table[0] if table and table[-1] - table[0] == len(table) - 1
                        and all(b - a == 1 for a, b in zip(table, table[1:])) else -1)
        meta.extras["contiguous_start"] = runs
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        position_ids = torch.tensor([positions], dtype=torch.long, device=dev)
        return meta, input_ids, position_ids

    def pad_step(self, meta: AttentionMetadata, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 size: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None:
        """The decode step ``meta`` as one of ``size`` sequences, for a compiled
        graph of that size: the step itself when it has that many, else with
        pad rows (token 0 at position 0) that write their K/V into one slot of
        the runner's pad block and attend to it alone, so no sequence's KV is
        touched. The pad block is taken from the pool on first use and kept;
        None (run the step as it is) when the pool has no block for it.
        """
        n = meta.num_seqs
        if size == n:
            return meta, input_ids, position_ids
        pad = self.pad_slot()
        if pad is None:
            return None
        block, slot = pad
        k, dev = size - n, self.device
        table = torch.zeros((size, meta.block_tables.shape[1]), dtype=meta.block_tables.dtype, device=dev)
        table[:n] = meta.block_tables
        table[n:, 0] = block
        padded = AttentionMetadata(
            kv=meta.kv,
            slot_mapping=torch.cat([meta.slot_mapping, torch.full((k,), slot, dtype=torch.int64, device=dev)]),
            block_tables=table,
            seq_lens=torch.cat([meta.seq_lens, torch.ones(k, dtype=meta.seq_lens.dtype, device=dev)]),
            cu_seqlens_q=torch.arange(size + 1, dtype=meta.cu_seqlens_q.dtype, device=dev),
            seq_lens_list=meta.seq_lens_list + [1] * k,
            query_lens_list=meta.query_lens_list + [1] * k,
            max_query_len=1,
            backend=meta.backend,
        )
        padded.extras["contiguous_start"] = meta.extras["contiguous_start"] + [block] * k
        zeros = torch.zeros((1, k), dtype=input_ids.dtype, device=dev)
        return padded, torch.cat([input_ids, zeros], 1), torch.cat([position_ids, zeros], 1)

    def pad_slot(self) -> tuple[int, int] | None:
        """``(block, slot)`` of the runner's pad block: a block taken from the
        pool on first call and kept, whose first slot pad rows of a step (and
        the capture of CUDA graphs) write to and read from, so no sequence's
        KV is touched; None when the pool has no free block for it."""
        if self._pad is None:
            seq = Sequence(token_ids=[0])
            try:
                slot = self.pool.prepare_write(seq, 1)[0]
            except OutOfBlocksError:
                return None
            self._pad = (seq, slot)
        seq, slot = self._pad
        return seq.block_table[0], slot

    @torch.inference_mode()
    def forward(self, batch: list[StepInput], all_logits: bool = False) -> torch.Tensor:
        """Compute the KV of every new token in place and the logits of each
        sequence's last new token (of every new token with ``all_logits``, for
        teacher forcing).

        On success each sequence's ``num_computed`` advances by its token count
        and newly filled blocks are hashed for prefix sharing. A decode step of
        a batch size :attr:`decode_graphs` covers runs through that graph, a
        one-sequence prefill through :attr:`prefill_graph` where it is built.

        Returns:
            ``[len(batch), vocab]`` float32 logits, or ``[total new tokens, vocab]``
            with ``all_logits``.
        """
        _FORWARDS_IN_PROCESS[0] += 1
        new = sum(len(item.tokens) for item in batch)
        timed = self.costs is not None and new >= MIN_PREFILL_TOKENS
        context = sum(item.seq.num_computed for item in batch) if timed else 0  # cached before this step
        started = time.perf_counter() if timed else 0.0
        meta, input_ids, position_ids = self.build_metadata(batch)
        graphs = self.decode_graphs
        size = graphs.size_for(meta) if graphs is not None and not all_logits else None
        padded = self.pad_step(meta, input_ids, position_ids, size) if size is not None else None
        if padded is not None:
            # Every token is its sequence's last: the graph keeps all logits (the pad rows' dropped).
            logits = graphs.run(*padded)[0, : len(batch)].float()  # type: ignore[union-attr]
            self.compiled_steps += 1
            n_last = len(batch)
        elif self.prefill_graph is not None and self.prefill_graph.covers(meta, all_logits):
            logits = self.prefill_graph.run(meta, input_ids, position_ids)[0].float()
            self.compiled_prefills += 1
            n_last = 1
        else:
            if all_logits:
                last = torch.arange(input_ids.shape[1], device=self.device)
            else:
                last = torch.tensor(
                    [int(c) - 1 for c in meta.cu_seqlens_q[1:].tolist()], dtype=torch.long, device=self.device
                )
            n_last = last.shape[0]
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=last,
                chatkv_meta=meta,
            )
            logits = out.logits[0].float()
        assert logits.shape[0] == n_last, (logits.shape, n_last)
        for item in batch:
            self.pool.commit(item.seq, len(item.tokens))
        if timed:
            if logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)  # prefill steps only: decode steps stay sync-free
            self.costs.record_prefill(new, time.perf_counter() - started, context)  # type: ignore[union-attr]
        return logits

    def write_placeholder_history(self, seq: Sequence, token_ids: list[int]) -> None:
        """Append ``token_ids`` to ``seq`` as computed, their K/V zeros written
        straight into the pool (nothing runs through the model): a history
        whose values do not matter, for a warm-up or a benchmark that times the
        steps after it. All-or-nothing like :meth:`BlockPool.write_tokens`."""
        layers, two, _, _, heads, dim = self.pool.kv.shape
        kv = torch.zeros((layers, two, len(token_ids), heads, dim), dtype=self.pool.kv.dtype, device=self.device)
        self.pool.write_tokens(seq, token_ids, kv)

    def warm_up_return(self, context_tokens: int, delta_tokens: int, decode_steps: int) -> int:
        """Run a throwaway returning turn: ``context_tokens`` of history whose
        KV is written straight into the pool (zeros: only the shapes matter),
        a prefill of ``delta_tokens`` over them, then ``decode_steps``
        one-token steps, so that a session's first turn after a restore finds
        that path warm. Its blocks are discarded. Runs on the loop. Returns
        the tokens run: 0 when the pool is short of free blocks for them.
        """
        total = context_tokens + delta_tokens + decode_steps
        if context_tokens < 1 or delta_tokens < 1 or total > self.pool.num_available * self.pool.block_size:
            return 0
        ids = [i % 1000 + 1 for i in range(total)]
        seq = Sequence(token_ids=[])
        try:
            self.write_placeholder_history(seq, ids[:context_tokens])
            seq.token_ids[:] = ids[: context_tokens + delta_tokens]
            self.forward([StepInput(seq, ids[context_tokens: context_tokens + delta_tokens])])
            for i in range(context_tokens + delta_tokens, total):
                seq.token_ids.append(ids[i])
                self.forward([StepInput(seq, ids[i: i + 1])])
            return total
        finally:
            self.pool.discard(seq)

    def warm_up(self, prompt_tokens: int, decode_steps: int, max_prefill_tokens: int) -> int:
        """Run a throwaway turn through the model: a prefill of ``prompt_tokens``
        tokens (in steps of at most ``max_prefill_tokens``), then ``decode_steps``
        one-token steps, so that the first real turn finds the thread pool
        started, the kernels chosen and compiled for these shapes and the
        allocator's arenas grown. Its blocks are discarded (nothing enters the
        prefix cache). Runs on the loop. Returns the tokens run: fewer when the
        pool is short of free blocks (0 if it has none).
        """
        free = self.pool.num_available * self.pool.block_size
        prompt_tokens = max(0, min(prompt_tokens, free - decode_steps))
        if prompt_tokens < 1:
            return 0
        seq = Sequence(token_ids=[i % 1000 + 1 for i in range(prompt_tokens)])
        try:
            while seq.num_computed < prompt_tokens:
                n = min(max_prefill_tokens, prompt_tokens - seq.num_computed)
                self.forward([StepInput(seq, seq.token_ids[seq.num_computed: seq.num_computed + n])])
            for _ in range(decode_steps):
                seq.token_ids.append(seq.token_ids[-1])
                self.forward([StepInput(seq, seq.token_ids[-1:])])
            return len(seq.token_ids)
        finally:
            self.pool.discard(seq)
