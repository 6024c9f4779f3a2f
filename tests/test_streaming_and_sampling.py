"""Incremental detokenization, stop strings and the sampler."""

from __future__ import annotations

import pytest
import torch

from chatkv.config import SamplingParams
from chatkv.detokenizer import TextStreamer
from chatkv.errors import ConfigError
from chatkv.sampling import Sampler
from chatkv.testing import tiny_tokenizer


def stream_all(tokenizer, text: str, stop=()) -> tuple[list[str], TextStreamer]:
    streamer = TextStreamer(tokenizer, stop)
    pieces = []
    for tid in tokenizer(text, add_special_tokens=False)["input_ids"]:
        pieces.append(streamer.push(tid))
        if streamer.stopped:
            break
    pieces.append(streamer.flush())
    return pieces, streamer


def test_multibyte_characters_are_never_split():
    tok = tiny_tokenizer()
    text = "Ünïcödé 🙂 and 日本語 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text) // 2  # byte-level: the emoji spans several tokens
    pieces, _ = stream_all(tok, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_across_tokens_is_cut_and_never_shown():
    tok = tiny_tokenizer()
    pieces, streamer = stream_all(tok, "Hello world. STOP here please", stop=["STOP"])
    assert streamer.stopped
    assert "".join(pieces) == "Hello world. "
    assert streamer.reply == "Hello world. "


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    tok = tiny_tokenizer()
    pieces, streamer = stream_all(tok, "a ST b STO c", stop=["STOP"])
    assert not streamer.stopped
    assert "".join(pieces) == "a ST b STO c"


def test_greedy_is_argmax_and_seeded_sampling_is_reproducible():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert Sampler(SamplingParams())(logits) == int(logits.argmax())
    p = SamplingParams(temperature=1.0, seed=123)
    s1, s2 = Sampler(p), Sampler(p)
    draws = [s1(logits) for _ in range(20)]
    assert draws == [s2(logits) for _ in range(20)]
    assert len(set(draws)) > 1  # it really samples


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(3))
    best = int(logits.argmax())
    assert all(Sampler(SamplingParams(temperature=2.0, top_k=1, seed=i))(logits) == best for i in range(10))
    assert all(Sampler(SamplingParams(temperature=2.0, top_p=1e-6, seed=i))(logits) == best for i in range(10))


def test_top_k_restricts_the_support():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(4))
    top5 = set(torch.topk(logits, 5).indices.tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=5, seed=0))
    assert {s(logits) for _ in range(200)} <= top5


def test_sampling_params_reject_bad_values_and_unknown_keys():
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError, match="unknown SamplingParams key"):
        SamplingParams.from_dict({"temprature": 0.5})
