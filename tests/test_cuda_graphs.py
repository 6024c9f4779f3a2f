"""Decode steps replayed from CUDA graphs (chatkv.cuda_graphs): the same logits
and the same KV as the model run as it is, for every batch size, a padded one
included, and never a sequence's KV touched by a pad row.

Without CUDA the same bookkeeping runs with nothing captured (the model called
over the static buffers, the kernels in Triton's interpreter); the engine-level
tests need CUDA and skip elsewhere.
"""

from __future__ import annotations

import logging

import pytest
import torch

from chatkv import Chat, EngineConfig
from chatkv.attention import TorchBackend
from chatkv.block_pool import BlockPool
from chatkv.cuda_graphs import CudaDecodeGraphs, graphs_unavailable
from chatkv.engine import Engine
from chatkv.models import load_model
from chatkv.runner import ModelRunner, StepInput
from chatkv.sequence import Sequence
from chatkv.testing import tiny_model

pytest.importorskip("triton")  # without CUDA, tests/conftest.py has turned Triton's interpreter on

from chatkv.attention.triton_backend import TritonBackend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if not TritonBackend.is_available(DEVICE):
    pytest.skip("Triton cannot run here (no CUDA, interpreter off)", allow_module_level=True)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
cuda = pytest.mark.cuda
TOL = dict(atol=1e-4, rtol=1e-4)


def _runner(model: torch.nn.Module, num_blocks: int = 64, block_size: int = 4) -> ModelRunner:
    cfg = model.config
    pool = BlockPool(num_blocks, block_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                     torch.float32, DEVICE, "test")
    return ModelRunner(model, pool, TritonBackend())


def _kv(runner: ModelRunner, seq: Sequence) -> torch.Tensor:
    """``seq``'s cached K/V ``[layers, 2, tokens, heads, dim]``, gathered from its blocks."""
    kv = runner.pool.kv[:, :, seq.block_table]
    layers, two, blocks, size, heads, dim = kv.shape
    return kv.reshape(layers, two, blocks * size, heads, dim)[:, :, : seq.num_computed]


def test_graphs_need_cuda_and_the_fused_backend() -> None:
    assert "CUDA device" in graphs_unavailable(torch.device("cpu"), TritonBackend())
    assert "triton attention backend" in graphs_unavailable(torch.device("cuda"), TorchBackend())
    assert graphs_unavailable(torch.device("cuda"), TritonBackend()) is None
    with pytest.raises(ValueError, match="positive"):
        CudaDecodeGraphs(None, (0, 2), max_context=64, block_size=4)


def test_decode_steps_through_the_static_buffers_compute_what_the_model_does() -> None:
    """Three sequences decode together (padded to the graph of 4), then the
    shortest alone (row 0 held the longest before: its stale table columns must
    not matter), then one whose table is wider than the buffers (runs as it
    is): logits and KV equal a plain runner's, and the pad rows touched no block
    but their own."""
    model, _ = tiny_model("llama")
    model.to(DEVICE)
    graphed, plain = _runner(model), _runner(model)
    pad_block, pad_slot = graphed.pad_slot()
    graphs = CudaDecodeGraphs(model, (1, 4), max_context=64, block_size=4, use_graphs=DEVICE.type == "cuda")
    assert graphs.capture(graphed.pool.kv, graphed.backend, pad_block, pad_slot) == 2
    assert graphs.ready == frozenset({1, 4}) and graphs.max_blocks == 16
    graphed.decode_graphs = graphs
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in (30, 5, 13)]
    seqs = {name: [Sequence(token_ids=list(p)) for p in prompts] for name in ("graphed", "plain")}
    runners = {"graphed": graphed, "plain": plain}

    def step(rows: list[int], token: int) -> dict[str, torch.Tensor]:
        out = {}
        for name, runner in runners.items():
            batch = []
            for i in rows:
                seqs[name][i].token_ids.append(token)
                batch.append(StepInput(seqs[name][i], [token]))
            out[name] = runner.forward(batch)
        return out

    for name, runner in runners.items():
        for seq in seqs[name]:
            runner.forward([StepInput(seq, list(seq.token_ids))])
    for t in range(4):  # 3 sequences through the graph of 4
        got = step([0, 1, 2], 40 + t)
        assert got["graphed"].shape == (3, model.config.vocab_size)
        torch.testing.assert_close(got["graphed"], got["plain"], **TOL)
    for t in range(3):  # the shortest alone, through the graph of 1
        got = step([1], 60 + t)
        torch.testing.assert_close(got["graphed"], got["plain"], **TOL)
    assert graphed.compiled_steps == 7
    history = torch.randint(1, 300, (70,), generator=gen).tolist()
    for name, runner in runners.items():  # 70 tokens: 18 blocks, wider than the buffers' 16
        long = Sequence(token_ids=list(history))
        runner.forward([StepInput(long, list(long.token_ids))])
        seqs[name].append(long)
    got = step([3], 7)
    torch.testing.assert_close(got["graphed"], got["plain"], **TOL)
    assert graphed.compiled_steps == 7
    for a, b in zip(seqs["graphed"], seqs["plain"]):
        assert a.block_table and pad_block not in a.block_table
        torch.testing.assert_close(_kv(graphed, a), _kv(plain, b), **TOL)


def _greedy_replies(loaded, compile: str, batch_sizes: tuple[int, ...]) -> tuple[list[list[int]], Engine]:
    engine = Engine(loaded, EngineConfig(num_blocks=256, block_size=4, compile=compile, device="cuda",
                                         attention_backend="triton", compile_batch_sizes=batch_sizes))
    engine.wait_warm(timeout=600)
    replies = []
    for i in range(3):
        chat = Chat(f"c{i}", system="be brief", engine=engine, persist=False, max_new_tokens=24, ignore_eos=True)
        chat.send("hello there, tell me a story about the lazy dog" + " again" * i)
        chat.send("and once more, longer")
        replies.append(chat.last_stats.token_ids)
        chat.close()
    return replies, engine


@cuda
@requires_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_chat_on_captured_graphs_replies_as_on_a_plain_engine(arch: str) -> None:
    graphed, engine = _greedy_replies(load_model(f"tiny:{arch}"), "on", (1, 2, 4))
    assert engine.compiled.result() == 3 and isinstance(engine.runner.decode_graphs, CudaDecodeGraphs)
    assert engine.runner.compiled_steps > 0
    assert engine.pool_stats().used_blocks == 1  # the pad block alone
    engine.close()
    plain, engine = _greedy_replies(load_model(f"tiny:{arch}"), "off", (1, 2, 4))
    assert engine.compiled.result() == 0 and engine.runner.decode_graphs is None
    engine.close()
    assert graphed == plain


@cuda
@requires_cuda
def test_batched_generation_on_captured_graphs_matches_the_plain_engine() -> None:
    """Five sequences decode together through graphs of 2 and 4 (padded from 3
    and 1 as they finish at different lengths, 5 run as they are)."""
    logits = {}
    for compile in ("on", "off"):
        engine = Engine(load_model("tiny:llama"), EngineConfig(
            num_blocks=256, block_size=4, compile=compile, device="cuda", attention_backend="triton",
            compile_batch_sizes=(2, 4)))
        engine.wait_warm(timeout=600)
        prompts = [[(7 * i + j) % 300 + 3 for i in range(9 + 5 * j)] for j in range(5)]

        def job() -> list[torch.Tensor]:
            seqs = [Sequence(token_ids=list(p)) for p in prompts]
            out = []
            try:
                engine.runner.forward([StepInput(s, list(s.token_ids)) for s in seqs])
                for t in range(8):
                    live = seqs[: 5 - t // 2]  # 5, 5, 4, 4, 3, 3, 2, 2 sequences
                    for s in live:
                        s.token_ids.append(10 + t)
                    out.append(engine.runner.forward([StepInput(s, [10 + t]) for s in live]).cpu())
                return out
            finally:
                for s in seqs:
                    engine.pool.discard(s)

        logits[compile] = engine.call(job)
        if compile == "on":
            assert engine.runner.compiled_steps == 6  # the two steps of 5 ran as they are
        engine.close()
    for got, want in zip(logits["on"], logits["off"]):
        torch.testing.assert_close(got, want, **TOL)


@cuda
@requires_cuda
def test_a_failed_capture_is_logged_and_decode_runs_as_it_is(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: CudaDecodeGraphs, *args: object) -> int:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(CudaDecodeGraphs, "capture", broken)
    with caplog.at_level(logging.WARNING, logger="chatkv.engine"):
        engine = Engine(load_model("tiny:llama"), EngineConfig(
            num_blocks=128, block_size=4, compile="on", device="cuda", attention_backend="triton"))
        engine.wait_warm(timeout=120)
    assert engine.compiled.result() == 0 and engine.runner.decode_graphs is None
    assert any("CUDA graphs failed" in r.message and r.exc_info for r in caplog.records)
    chat = Chat("f", engine=engine, persist=False, max_new_tokens=4)
    assert chat.send("hello") is not None and engine.runner.compiled_steps == 0
    chat.close()
    engine.close()
