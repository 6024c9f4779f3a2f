"""Linear layers pre-packed for oneDNN (chatkv.prepack): same results, safe to copy, off when asked."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from chatkv.prepack import PackedLinear, _ops_available, prepack, unpack, warm_row_counts
from chatkv.testing import tiny_model

pytestmark = pytest.mark.skipif(_ops_available() is not None, reason=f"no oneDNN packed linears: {_ops_available()}")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_model_computes_what_the_stock_model_does(dtype):
    model, _ = tiny_model("llama")
    model = model.to(dtype)
    stock = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 11))
    want = _logits(stock, ids)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert prepack(model) == linears > 0
    assert all(type(m) is PackedLinear for m in model.modules() if isinstance(m, nn.Linear))
    got = _logits(model, ids)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same bf16 products, bit for bit
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert prepack(model) == linears  # idempotent
    torch.testing.assert_close(_logits(model, ids), got, atol=0, rtol=0)


def test_a_copy_of_a_packed_model_computes_stock_and_a_changed_weight_is_used():
    model, _ = tiny_model("llama")
    prepack(model)
    twin = copy.deepcopy(model)  # the packed weights are not copied: the twin uses F.linear
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    torch.testing.assert_close(_logits(twin, ids), _logits(model, ids), atol=1e-5, rtol=1e-5)
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(2, layer.in_features)
    with torch.no_grad():
        layer.weight.mul_(2)  # packed from the old weight: the layer must not use it any more
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
    assert unpack(model) > 0 and not any(type(m) is PackedLinear for m in model.modules())


def test_gradients_flow_through_a_packed_layer():
    model, _ = tiny_model("llama")
    prepack(model)
    layer = model.lm_head
    x = torch.randn(3, layer.in_features, requires_grad=True)
    layer(x).sum().backward()  # with autograd on, the stock path runs
    assert x.grad is not None and layer.weight.grad is not None


def test_chatkv_prepack_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("CHATKV_PREPACK", "0")
    model, _ = tiny_model("llama")
    assert prepack(model) == 0
    assert not any(type(m) is PackedLinear for m in model.modules())


def test_an_engine_packs_its_model_unless_told_not_to():
    from chatkv import EngineConfig
    from chatkv.engine import Engine
    from chatkv.models import load_model

    packed = Engine(load_model("tiny:llama"), EngineConfig(warmup=False))
    plain = Engine(load_model("tiny:llama"), EngineConfig(warmup=False, prepack=False))
    assert packed.runner.packed_linears > 0
    assert plain.runner.packed_linears == 0
    assert not any(type(m) is PackedLinear for m in plain.loaded.model.modules())


def test_warming_row_counts_runs_each_linear_shape_once_per_count_and_changes_nothing():
    model, _ = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    prepack(model)
    want = _logits(model, ids)
    head = model.get_output_embeddings()
    # The shapes oneDNN runs: a layer packed with others (q, k and v; gate and up) runs their joint product.
    shapes = {(m.in_features, sum(m._chatkv_group.sizes) if getattr(m, "_chatkv_group", None) else m.out_features)
              for m in model.modules() if isinstance(m, PackedLinear) and m is not head}
    # Row counts no engine's warm-up runs: every other shape for each of 3, the
    # output projection (a shape of its own here) for the first 2.
    assert (head.in_features, head.out_features) not in shapes
    rows = range(1000, 1003)
    assert warm_row_counts(tiny_model("llama")[0], rows, head_rows=1001) == 0  # nothing packed: nothing run
    assert warm_row_counts(model, rows, head_rows=1001) == 3 * len(shapes) + 2
    torch.testing.assert_close(_logits(model, ids), want, atol=0, rtol=0)
    assert warm_row_counts(model, rows, head_rows=1001) == 0  # already warm in this process


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projections_of_one_input_run_as_one_product_with_the_same_results(dtype, linear_products):
    """q, k and v (and gate and up) of a layer are packed as one product: one
    oneDNN call where there were three (two), each layer still returning its
    own part, bit for bit; a member whose weight changed sends its group back
    to one product per layer."""
    from chatkv import prepack as module

    model, _ = tiny_model("llama")
    model = model.to(dtype)
    stock = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    prepack(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj._chatkv_group is attn.v_proj._chatkv_group is not mlp.up_proj._chatkv_group
    assert module._PACKED.get(attn.k_proj) is None and module._PACKED.get(attn.o_proj) is not None  # one copy each
    calls = linear_products
    layers = model.config.num_hidden_layers
    want = _logits(stock, ids)
    got = _logits(model, ids)
    assert len(calls) == 4 * layers + 1  # per layer qkv, o, gate-up, down; then the head
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        for m in (model, stock):
            m.model.layers[1].self_attn.k_proj.weight.mul_(2)
    calls.clear()
    torch.testing.assert_close(_logits(model, ids), _logits(stock, ids), atol=1e-5, rtol=1e-5)
    assert len(calls) == 4 * layers  # layer 1's q, k and v by F.linear
    new = torch.randn_like(model.model.layers[0].mlp.up_proj.weight)
    for m in (model, stock):  # a member's weight replaced, not changed in place
        m.model.layers[0].mlp.up_proj.weight = nn.Parameter(new.clone())
    torch.testing.assert_close(_logits(model, ids), _logits(stock, ids), atol=1e-5, rtol=1e-5)
    assert prepack(model)  # packed again from the new weight
    calls.clear()
    torch.testing.assert_close(_logits(model, ids), _logits(stock, ids), atol=1e-5, rtol=1e-5)
    assert len(calls) == 4 * layers + 1
    twin = copy.deepcopy(model)  # a copy multiplies layer by layer, unpacked
    assert twin.model.layers[0].self_attn.q_proj._chatkv_group is None
    torch.testing.assert_close(_logits(twin, ids), _logits(model, ids), atol=1e-5, rtol=1e-5)
    assert unpack(model) and not hasattr(attn.q_proj, "_chatkv_group")

