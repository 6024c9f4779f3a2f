"""The compiled decode and prefill steps (chatkv.compile): same logits as the
model run as it is, used only for the steps they were built for (decode batch
sizes; one sequence's prefill of any length), never a stall or a failure when
compiling goes wrong."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from chatkv import Chat, EngineConfig
from chatkv.compile import COMPILE_ENV, DecodeGraphs, PrefillGraph, parse_compile, unavailable
from chatkv.engine import Engine
from chatkv.errors import ConfigError
from chatkv.models import load_model
from chatkv.runner import StepInput
from chatkv.sequence import Sequence

needs_inductor = pytest.mark.skipif(unavailable(torch.device("cpu")) is not None,
                                    reason=f"cannot compile here: {unavailable(torch.device('cpu'))}")


def test_the_setting_is_parsed_and_a_bad_one_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_compile(True) is True and parse_compile("off") is False and parse_compile("ON") is True
    monkeypatch.setenv(COMPILE_ENV, "no")
    assert parse_compile(None) is False
    monkeypatch.delenv(COMPILE_ENV)
    assert parse_compile(None) == "auto"
    with pytest.raises(ConfigError, match="compile must be"):
        EngineConfig(compile="sometimes")
    with pytest.raises(ConfigError, match="compile_batch_sizes"):
        EngineConfig(compile_batch_sizes=(1, 0))


def _decode_logits(engine: Engine, prompt: list[int], tokens: list[int], batch: int = 1) -> list[torch.Tensor]:
    """Prefill ``batch`` copies of ``prompt``, then feed ``tokens`` one step at a
    time to all of them (teacher forcing); each step's logits ``[batch, vocab]``."""
    runner = engine.runner

    def job() -> list[torch.Tensor]:
        seqs = [Sequence(token_ids=list(prompt)) for _ in range(batch)]
        try:
            runner.forward([StepInput(s, s.token_ids[:]) for s in seqs])
            out = []
            for t in tokens:
                for s in seqs:
                    s.token_ids.append(t)
                out.append(runner.forward([StepInput(s, s.token_ids[-1:]) for s in seqs]).clone())
            return out
        finally:
            for s in seqs:
                runner.pool.discard(s)

    return engine.call(job)


@needs_inductor
def test_compiled_decode_steps_compute_what_the_model_does(linear_products: list[int]) -> None:
    loaded = load_model("tiny:llama")
    compiled = Engine(loaded, EngineConfig(num_blocks=256, block_size=4, compile="on", compile_batch_sizes=(1,)))
    assert compiled.wait_warm(timeout=600) > 0
    assert compiled.compiled.result() == 1
    prompt = [(7 * i) % 300 + 3 for i in range(37)]
    tokens = [(5 * i) % 300 + 3 for i in range(12)]
    before = compiled.runner.compiled_steps
    linear_products.clear()  # the warm-up's and the compile's products done
    got = _decode_logits(compiled, prompt, tokens)
    assert compiled.runner.compiled_steps - before == len(tokens)  # every decode step ran compiled
    if compiled.runner.packed_linears:
        # Per layer: q, k and v as one product, gate and up as one, o and down; then the head.
        layers = loaded.model.config.num_hidden_layers
        assert len(linear_products) == (1 + len(tokens)) * (4 * layers + 1)
    two = _decode_logits(compiled, prompt, tokens, batch=2)  # no graph for 2 sequences: runs as it is
    assert compiled.runner.compiled_steps - before == len(tokens)
    compiled.close()

    plain = Engine(loaded, EngineConfig(num_blocks=256, block_size=4, compile="off"))
    plain.wait_warm(timeout=600)
    assert plain.compiled.result() == 0 and plain.runner.decode_graphs is None
    want = _decode_logits(plain, prompt, tokens)
    plain.close()
    for step, (g, w, pair) in enumerate(zip(got, want, two)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
        torch.testing.assert_close(pair[0], w[0], atol=1e-4, rtol=1e-4)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


@needs_inductor
def test_two_compiled_engines_on_models_of_one_class_each_compute_their_own() -> None:
    # The graphs keep no guards on the model's modules (chatkv.compile), so each
    # must be compiled from a function of its own: were the second engine's
    # steps to run the first's graph, they would use the first model's norm
    # epsilon, which the graph holds as a constant.
    first, second = load_model("tiny:llama"), load_model("tiny:llama")
    for module in second.model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 0.5
    prompt = [(7 * i) % 300 + 3 for i in range(37)]
    tokens = [(5 * i) % 300 + 3 for i in range(8)]
    config = dict(num_blocks=256, block_size=4, compile_batch_sizes=(1,))
    engines = []
    for loaded in (first, second):  # one compiles while the other idles (see the test below)
        engines.append(Engine(loaded, EngineConfig(compile="on", **config)))
        assert engines[-1].wait_warm(timeout=600) > 0 and engines[-1].compiled.result() == 1
    before = [engine.runner.compiled_steps for engine in engines]
    got = [_decode_logits(engine, prompt, tokens) for engine in engines]  # both engines alive, in turn
    got += [_decode_logits(engine, prompt, tokens) for engine in reversed(engines)][::-1]
    for engine, steps in zip(engines, before):
        assert engine.runner.compiled_steps - steps == 2 * len(tokens)  # every decode step ran compiled
        engine.close()
    want = []
    for loaded in (first, second):
        plain = Engine(loaded, EngineConfig(compile="off", **config))
        plain.wait_warm(timeout=600)
        want.append(_decode_logits(plain, prompt, tokens))
        plain.close()
    assert not torch.allclose(want[0][0], want[1][0], atol=1e-2)  # the epsilon matters
    for i, steps in enumerate(got):
        for step, (g, w) in enumerate(zip(steps, want[i % 2])):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"engine {i % 2} step {step}: {m}")


@needs_inductor
def test_smaller_decode_batches_run_padded_through_a_larger_graph() -> None:
    loaded = load_model("tiny:llama")
    blocks = 256
    compiled = Engine(loaded, EngineConfig(num_blocks=blocks, block_size=4, compile="on", compile_batch_sizes=(4,)))
    compiled.wait_warm(timeout=600)
    assert compiled.compiled.result() == 1
    prompt = [(7 * i) % 300 + 3 for i in range(37)]
    tokens = [(5 * i) % 300 + 3 for i in range(9)]
    before = compiled.runner.compiled_steps
    got = {b: _decode_logits(compiled, prompt, tokens, batch=b) for b in (1, 3, 4)}
    assert compiled.runner.compiled_steps - before == 3 * len(tokens)  # 1 and 3 sequences ran as 4
    five = _decode_logits(compiled, prompt, tokens, batch=5)  # larger than every graph: runs as it is
    assert compiled.runner.compiled_steps - before == 3 * len(tokens)
    # The pad rows' block is the only one left taken once the sequences are gone.
    assert compiled.pool_stats().used_blocks == 1
    compiled.close()

    plain = Engine(loaded, EngineConfig(num_blocks=blocks, block_size=4, compile="off"))
    plain.wait_warm(timeout=600)
    want = _decode_logits(plain, prompt, tokens, batch=1)
    plain.close()
    for b, steps in [*got.items(), (5, five)]:
        for step, (g, w) in enumerate(zip(steps, want)):
            assert g.shape[0] == b
            for row in g:  # every sequence's logits, the padded steps' included, are the plain model's
                torch.testing.assert_close(row, w[0], atol=1e-4, rtol=1e-4, msg=lambda m: f"batch {b} step {step}: {m}")


@needs_inductor
def test_a_chat_on_a_compiled_engine_replies_as_on_a_plain_one() -> None:
    loaded = load_model("tiny:qwen2")  # a sliding window on one layer: the operator passes it on
    replies = []
    for mode in ("on", "off"):
        engine = Engine(loaded, EngineConfig(num_blocks=256, block_size=4, compile=mode))
        engine.wait_warm(timeout=600)
        chat = Chat("c", system="be brief", engine=engine, persist=False, max_new_tokens=40, ignore_eos=True)
        chat.send("hello there, tell me a story about the lazy dog")
        chat.send("and again, longer")
        replies.append(chat.last_stats.token_ids)
        assert (engine.runner.compiled_steps > 0) is (mode == "on")
        chat.close()
        engine.close()
    assert replies[0] == replies[1]


def test_a_failed_compile_is_logged_and_the_engine_runs_uncompiled(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: DecodeGraphs, *args: object) -> int:
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(DecodeGraphs, "build", broken)
    monkeypatch.setattr("chatkv.engine.should_compile", lambda setting, device: (True, "compiling"))
    with caplog.at_level(logging.WARNING, logger="chatkv.engine"):
        engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=128, block_size=4, compile="on"))
        engine.wait_warm(timeout=120)
    assert engine.compiled.result() == 0 and engine.runner.decode_graphs is None
    assert any("compiling the decode step failed" in r.message and r.exc_info for r in caplog.records)
    chat = Chat("f", engine=engine, persist=False, max_new_tokens=4)
    assert chat.send("hello") is not None and engine.runner.compiled_steps == 0
    chat.close()
    engine.close()


@needs_inductor
@pytest.mark.parametrize("beside", ["the same engine", "another engine"])
def test_a_compile_that_fails_while_a_turn_runs_beside_it_is_tried_again(
        beside: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Building the graph's guards races with an eager forward in another thread
    # (transformers' kernel wrappers keep process-wide state while Dynamo
    # traces), whichever engine's model runs: the first attempt runs a real
    # turn meanwhile and fails; the engine compiles again once idle.
    other = None
    if beside == "another engine":
        other = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=128, block_size=4, compile="off"))
        other.wait_warm(timeout=600)
    real = DecodeGraphs.build
    attempts: list[int] = []
    constructed = threading.Event()  # the compile thread starts inside Engine(): wait for `engine`

    def racing(self: DecodeGraphs, pool_kv: torch.Tensor, backend: object) -> int:
        assert constructed.wait(timeout=600)
        attempts.append(1)
        if len(attempts) == 1:
            turn = Chat("beside", engine=other or engine, persist=False, max_new_tokens=3).send("hi")
            assert turn is not None
            raise AssertionError("Guard failed on the same frame it was created")
        return real(self, pool_kv, backend)

    monkeypatch.setattr(DecodeGraphs, "build", racing)
    with caplog.at_level(logging.WARNING, logger="chatkv.engine"):
        engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=128, block_size=4, compile="on",
                                                               compile_batch_sizes=(1,)))
        constructed.set()
        assert engine.compiled.result(timeout=600) == 1
    assert len(attempts) == 2 and engine.runner.decode_graphs is not None
    assert any("attempt 1 of 3" in r.message for r in caplog.records)
    chat = Chat("after", engine=engine, persist=False, max_new_tokens=6, ignore_eos=True)
    before = engine.runner.compiled_steps
    chat.send("hello")
    assert engine.runner.compiled_steps - before >= 5
    chat.close()
    engine.close()
    if other is not None:
        other.close()


def test_a_compile_that_fails_with_nothing_beside_it_is_not_tried_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def broken(self: DecodeGraphs, *args: object) -> int:
        calls.append(1)
        raise RuntimeError("this model does not compile")

    monkeypatch.setattr(DecodeGraphs, "build", broken)
    monkeypatch.setattr("chatkv.engine.should_compile", lambda setting, device: (True, "compiling"))
    engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=128, block_size=4, compile="on"))
    assert engine.compiled.result(timeout=120) == 0 and calls == [1]
    engine.close()


@pytest.mark.smollm2
@needs_inductor
def test_smollm2_compiled_greedy_replies_match_stock_transformers(smollm2, smollm2_reference) -> None:
    from test_smollm2 import SYSTEM, TURNS, stock_turn

    engine = Engine(smollm2, EngineConfig(kv_budget_bytes=256 << 20, compile="on"))
    assert engine.wait_warm(timeout=900) > 0 and engine.compiled.result() == 1
    chat = Chat("smol-compiled", system=SYSTEM, engine=engine, persist=False, max_new_tokens=24)
    for turn, text in enumerate(TURNS):
        history = chat.messages + [{"role": "user", "content": text}]
        want, _, _ = stock_turn(smollm2_reference, engine.tokenizer, history)
        chat.send(text)
        assert chat.last_stats.token_ids == want, f"turn {turn}"
    assert engine.runner.compiled_steps >= 3 * 20
    assert engine.runner.compiled_prefills >= len(TURNS)  # each turn's new message ran through the prefill graph
    chat.close()
    engine.close()


@needs_inductor
def test_compiled_prefill_steps_compute_what_the_model_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # Any step the one prefill graph did not cover would compile again: fail instead.
    monkeypatch.setattr("chatkv.compile.RUN_STANCE", "fail_on_recompile")
    loaded = load_model("tiny:llama")
    # New tokens per step of one sequence: a fresh prompt, then returning turns over the KV before each.
    lengths = [2, 3, 9, 17, 40]

    def run(engine: Engine) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        runner = engine.runner

        def job() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            seq = Sequence(token_ids=[])
            logits = []
            try:
                for i, n in enumerate(lengths * 2):
                    new = [(7 * i + 3 * j) % 200 + 5 for j in range(n)]
                    seq.token_ids.extend(new)
                    logits.append(runner.forward([StepInput(seq, new)]).clone())
                kv = [runner.pool.kv[:, :, b].clone() for b in seq.block_table]
                return logits, kv
            finally:
                runner.pool.discard(seq)

        return engine.call(job)

    compiled = Engine(loaded, EngineConfig(num_blocks=256, block_size=4, compile="on"))
    compiled.wait_warm(timeout=600)
    assert compiled.compiled.result() == 1 and compiled.runner.prefill_graph is not None
    before = compiled.runner.compiled_prefills
    got, got_kv = run(compiled)
    assert compiled.runner.compiled_prefills - before == 2 * len(lengths)  # every step ran through the graph
    teacher = _decode_logits(compiled, [5, 6, 7], [8, 9])  # a decode step and all-logits runs are not prefill
    assert compiled.runner.compiled_prefills - before == 2 * len(lengths) + 1  # only the 3-token prompt
    compiled.close()

    plain = Engine(loaded, EngineConfig(num_blocks=256, block_size=4, compile="off"))
    want, want_kv = run(plain)
    assert plain.runner.prefill_graph is None
    plain.close()
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape == (1, w.shape[-1])
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    assert len(got_kv) == len(want_kv)
    for g, w in zip(got_kv, want_kv):  # the KV it wrote into the pool is the model's
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert len(teacher) == 2


@needs_inductor
def test_an_engine_told_not_to_compile_prefill_compiles_decode_only() -> None:
    engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=128, block_size=4, compile="on",
                                                           compile_prefill=False))
    engine.wait_warm(timeout=600)
    assert engine.compiled.result() == 1 and engine.runner.decode_graphs is not None
    assert engine.runner.prefill_graph is None
    chat = Chat("c", engine=engine, persist=False, max_new_tokens=4)
    chat.send("hello there")
    assert engine.runner.compiled_prefills == 0 and engine.runner.compiled_steps > 0
    chat.close()
    engine.close()


@needs_inductor
def test_a_failed_prefill_compile_is_logged_and_leaves_the_decode_graphs(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def fail(self, pool_kv, backend):
        raise RuntimeError("no dynamic shapes today")

    monkeypatch.setattr(PrefillGraph, "build", fail)
    with caplog.at_level(logging.WARNING, logger="chatkv.engine"):
        engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=128, block_size=4, compile="on"))
        engine.wait_warm(timeout=600)
    assert engine.compiled.result() == 1 and engine.runner.decode_graphs is not None
    assert engine.runner.prefill_graph is None
    assert any("compiling the prefill step failed" in r.message and r.exc_info for r in caplog.records)
    chat = Chat("c", engine=engine, persist=False, max_new_tokens=4)
    assert chat.send("hello") is not None
    assert engine.runner.compiled_prefills == 0 and engine.runner.compiled_steps > 0
    chat.close()
    engine.close()
