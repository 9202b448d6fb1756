"""The lean SwiGLU and RMSNorm against transformers' own modules: the same values and gradients,
fewer saved activations, and every module's own forward back after the block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from palaestra.models import lean_layers as lean_layers_module
from palaestra.models.lean_layers import lean_layers, rms_norm, swiglu
from tests.support.tiny_models import build_tiny_model, build_tokenizer


def grads_of(module: torch.nn.Module, x: torch.Tensor, lean: bool, dtype=None):
    """Output, input gradient and parameter gradients of ``module`` on ``x`` under a fixed
    random upstream gradient, with the stock or the lean forward (under autocast if dtype)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)
    with autocast, lean_layers(module) if lean else torch.enable_grad():
        out = module(x)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(upstream.to(out.dtype))
    params = {name: p.grad.clone() for name, p in module.named_parameters()}
    return out.detach(), x.grad.clone(), params


def saved_bytes(run) -> int:
    """Bytes of distinct storages autograd keeps for the backward while ``run()`` runs
    (parameters not counted: they are kept either way)."""
    seen, total = set(), 0

    def pack(tensor):
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run(seen)
    return total


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_gives_the_stock_mlps_values_and_gradients(bias):
    torch.manual_seed(0)
    mlp = LlamaMLP(
        LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=4, mlp_bias=bias)
    )
    x = torch.randn(3, 5, 24)
    out, dx, dparams = grads_of(mlp, x, lean=False)
    lean_out, lean_dx, lean_dparams = grads_of(mlp, x, lean=True)
    torch.testing.assert_close(lean_out, out, rtol=0, atol=1e-6)
    torch.testing.assert_close(lean_dx, dx, rtol=0, atol=1e-6)
    assert (
        lean_dparams.keys()
        == dparams.keys()
        == {
            f"{p}_proj.{w}"
            for p in ("gate", "up", "down")
            for w in (("weight", "bias") if bias else ("weight",))
        }
    )
    for name, grad in dparams.items():
        torch.testing.assert_close(lean_dparams[name], grad, rtol=0, atol=1e-5, msg=name)


def test_rms_norm_gives_the_stock_norms_values_and_gradients():
    torch.manual_seed(0)
    norm = LlamaRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)  # not all ones, so the weight's part of the gradient shows
    x = 3 * torch.randn(4, 6, 24)
    out, dx, dparams = grads_of(norm, x, lean=False)
    lean_out, lean_dx, lean_dparams = grads_of(norm, x, lean=True)
    torch.testing.assert_close(lean_out, out, rtol=0, atol=1e-6)
    torch.testing.assert_close(lean_dx, dx, rtol=0, atol=1e-6)
    torch.testing.assert_close(lean_dparams["weight"], dparams["weight"], rtol=0, atol=1e-5)


def test_rms_norm_backward_is_the_hand_derived_formula():
    # y = w * x * r with r = (mean(x^2) + eps)^-1/2; for x = (3, 4), w = (1, 2), eps = 0:
    # r = 1 / sqrt(12.5) and xhat = x * r. Under upstream (1, 0) the input's gradient is
    # r * (1 - xhat_0^2 / 2, -xhat_0 xhat_1 / 2) and the weight's is (xhat_0, 0).
    x = torch.tensor([[3.0, 4.0]], requires_grad=True)
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    y = rms_norm(x, w, 0.0)
    y.backward(torch.tensor([[1.0, 0.0]]))
    r = 12.5**-0.5
    xhat = (3 * r, 4 * r)
    torch.testing.assert_close(y.detach(), torch.tensor([[xhat[0], 2 * xhat[1]]]))
    expected = torch.tensor([[r * (1 - xhat[0] ** 2 / 2), -r * xhat[0] * xhat[1] / 2]])
    torch.testing.assert_close(x.grad, expected)
    torch.testing.assert_close(w.grad, torch.tensor([xhat[0], 0.0]))


def test_swiglu_under_bfloat16_autocast_computes_in_bfloat16_like_the_stock_mlp():
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4))
    x = torch.randn(2, 7, 32)
    out, dx, dparams = grads_of(mlp, x, lean=False, dtype=torch.bfloat16)
    lean_out, lean_dx, lean_dparams = grads_of(mlp, x, lean=True, dtype=torch.bfloat16)
    assert lean_out.dtype == out.dtype == torch.bfloat16
    assert lean_dx.dtype == dx.dtype == torch.float32  # the input's own dtype
    # The same bfloat16 products: equal up to a bfloat16 rounding or two.
    torch.testing.assert_close(lean_out.float(), out.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lean_dx, dx, rtol=2e-2, atol=2e-2)
    for name, grad in dparams.items():
        assert lean_dparams[name].dtype == torch.float32
        cosine = torch.nn.functional.cosine_similarity(
            lean_dparams[name].flatten(), grad.flatten(), dim=0
        )
        assert cosine > 0.999, name


def test_a_models_loss_and_gradients_are_unchanged_and_fewer_activations_are_kept():
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, intermediate_size=64)
    config = model.config
    ids = torch.randint(0, len(tokenizer), (3, 10), generator=torch.Generator().manual_seed(0))

    def loss_and_grads(lean: bool):
        model.zero_grad(set_to_none=True)
        kept = {}

        def run(seen):
            seen.update(p.untyped_storage().data_ptr() for p in model.parameters())
            with lean_layers(model) if lean else torch.enable_grad():
                kept["loss"] = model(input_ids=ids, labels=ids).loss

        kept["bytes"] = saved_bytes(run)
        kept["loss"].backward()
        return kept, {n: p.grad.clone() for n, p in model.named_parameters()}

    stock, stock_grads = loss_and_grads(lean=False)
    lean, lean_grads = loss_and_grads(lean=True)
    torch.testing.assert_close(lean["loss"], stock["loss"], rtol=0, atol=1e-6)
    for name, grad in stock_grads.items():
        torch.testing.assert_close(lean_grads[name], grad, rtol=0, atol=1e-5, msg=name)
    # Per layer and token, float32: the MLP no longer keeps silu(gate) and its product with up
    # (2 x intermediate); each of the layer's two norms no longer keeps its output (hidden),
    # nor does the final norm.
    tokens, layers = ids.numel(), config.num_hidden_layers
    fewer = (
        4
        * tokens
        * (layers * (2 * config.intermediate_size + 2 * config.hidden_size) + config.hidden_size)
    )
    assert stock["bytes"] - lean["bytes"] == fewer
    # And after the block every module runs its own forward again.
    assert not any("forward" in vars(module) for module in model.modules())


def test_lora_wrapped_projections_keep_their_own_forward():
    peft = pytest.importorskip("peft")
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]
    )
    lora = peft.get_peft_model(model, config)
    with lean_layers(lora) as patched:
        # The MLPs are left alone (their projections are LoRA layers); the norms are not:
        # two per layer and the final one.
        assert patched == 2 * model.config.num_hidden_layers + 1
        kinds = {type(m).__name__ for m in lora.modules() if "forward" in vars(m)}
    assert kinds == {"LlamaRMSNorm"}


def test_swiglu_keeps_only_its_input_gate_and_up():
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=48, num_attention_heads=4))
    x = torch.randn(5, 16, requires_grad=True)

    def run(seen):
        seen.update(p.untyped_storage().data_ptr() for p in mlp.parameters())
        swiglu(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj)

    assert saved_bytes(run) == 4 * 5 * (16 + 2 * 48)


def test_gqa_attention_with_a_mask_gives_the_stock_bits_and_keeps_unrepeated_keys():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from palaestra.models.lean_layers import gqa_attention

    class Layer(torch.nn.Module):  # what transformers' attention functions read of a layer
        num_key_value_groups = 3
        is_causal = True

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, 5, 8, generator=generator, requires_grad=True)
    key = torch.randn(2, 2, 9, 8, generator=generator, requires_grad=True)
    value = torch.randn(2, 2, 9, 8, generator=generator, requires_grad=True)
    # 5 new tokens after a 4-token prefix: each sees the prefix and itself and what precedes it.
    mask = torch.ones(5, 9, dtype=torch.bool).tril(4)[None, None].expand(2, 1, 5, 9)
    kept = {}

    def attend(function, name):
        def run(seen):
            seen.update({query.untyped_storage().data_ptr()})
            kept[name] = function(Layer(), query, key, value, mask, scaling=8**-0.5)[0]

        return saved_bytes(run)

    stock_bytes = attend(sdpa_attention_forward, "stock")
    lean_bytes = attend(gqa_attention, "lean")
    assert torch.equal(kept["lean"], kept["stock"])
    # The stock path keeps keys and values repeated for all 6 query heads (2 x 2 x 6 x 9 x 8
    # floats each); the lean one keeps them with their own 2 heads.
    assert stock_bytes - lean_bytes == 4 * 2 * (2 * 6 * 9 * 8 - 2 * 2 * 9 * 8)


def test_the_attention_implementation_is_the_models_own_again_after_the_block():
    model = build_tiny_model(build_tokenizer())
    model.config._attn_implementation = "sdpa"
    with lean_layers(model):
        assert model.config._attn_implementation == "palaestra_lean_sdpa"
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    with lean_layers(model):
        assert model.config._attn_implementation == "eager"  # only SDPA is swapped


def test_gradients_in_place_equal_autograds_over_weights_used_twice_in_each_of_two_passes():
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, intermediate_size=64)
    ids = torch.randint(0, len(tokenizer), (4, 9), generator=torch.Generator().manual_seed(0))

    def grads(in_place: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        # Two micro-batches, each reading every weight twice (as a group's prompt pass and
        # answers pass do): the second adds to the .grad the first left.
        for rows in ([0, 1], [2, 3]):
            with lean_layers(model, grads_in_place=in_place):
                loss = model(input_ids=ids[rows], labels=ids[rows]).loss
                loss = loss + 0.5 * model(input_ids=ids[rows, 2:], labels=ids[rows, 2:]).loss
            loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    stock, in_place = grads(in_place=False), grads(in_place=True)
    assert in_place.keys() == stock.keys()
    for name, grad in stock.items():
        torch.testing.assert_close(in_place[name], grad, rtol=0, atol=1e-5, msg=name)
    with lean_layers(model, grads_in_place=True) as patched:
        projections = {
            name.rsplit(".", 1)[-1] for name, m in model.named_modules() if "forward" in vars(m)
        }
    # Per layer: the MLP, two norms and the four attention projections; the final norm and
    # the input embedding.
    assert patched == 7 * model.config.num_hidden_layers + 2
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "mlp", "embed_tokens"} <= projections
    assert not any("forward" in vars(module) for module in model.modules())


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_an_embeddings_gradient_in_place_is_autograds_and_skips_the_padding_row(padding_idx):
    from palaestra.models.lean_layers import embedding_grads_in_place

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(7, 3, padding_idx=padding_idx)
    ids = torch.tensor([[2, 5, 5, 0], [1, 2, 6, 5]])  # repeated rows sum; row 2 is padding
    upstream = torch.randn(2, 4, 3)
    (embedding(ids) * upstream).sum().backward()
    expected = embedding.weight.grad.clone()
    embedding.weight.grad = torch.ones(7, 3)  # what the head (a tied weight) left there
    (embedding_grads_in_place(ids, embedding) * upstream).sum().backward()
    torch.testing.assert_close(embedding.weight.grad, expected + 1, rtol=0, atol=1e-6)
    assert (embedding.weight.grad[2] == 1).all() == (padding_idx == 2)
    assert (embedding.weight.grad[[3, 4]] == 1).all()  # rows not looked up are left alone


@pytest.mark.parametrize("in_place", [False, True])
def test_a_weight_used_twice_has_its_gradient_before_its_last_use_is_differentiated(in_place):
    # What in place is for: autograd holds a weight's gradient until every use has sent its
    # share, a second gradient-sized tensor through the backward; in place, the first share
    # differentiated is in .grad already.
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4))
    first, second = torch.randn(3, 16, requires_grad=True), torch.randn(3, 16, requires_grad=True)
    seen = []
    second.register_hook(lambda grad: seen.append(mlp.down_proj.weight.grad is not None))
    with lean_layers(mlp, grads_in_place=in_place):
        out = mlp(first).sum() + mlp(second).sum()
    out.backward()  # the second use is differentiated first
    assert seen == [in_place]
    assert mlp.down_proj.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_bfloat16_pass_attends_in_float32_even_under_autocast(dtype):
    # Under autocast a model's queries arrive in float32 (the rotary embedding's float32 cos
    # and sin promote them) and SDPA would cast them to bfloat16; without it, in bfloat16.
    from palaestra.models.lean_layers import gqa_attention

    class Layer(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    generator = torch.Generator().manual_seed(0)
    shapes = {"query": (2, 6, 5, 8), "key": (2, 2, 9, 8), "value": (2, 2, 9, 8)}
    leaves = {
        name: torch.randn(shape, generator=generator).bfloat16().to(dtype).requires_grad_()
        for name, shape in shapes.items()
    }
    mask = torch.ones(5, 9, dtype=torch.bool).tril(4)[None, None].expand(2, 1, 5, 9)
    grad_out = torch.randn(2, 5, 6, 8, generator=generator).bfloat16()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = gqa_attention(Layer(), *leaves.values(), mask, scaling=8**-0.5)
    out.backward(grad_out)

    # The reference: SDPA over the same numbers in float32, rounded to bfloat16 once.
    refs = {name: leaf.detach().float().requires_grad_() for name, leaf in leaves.items()}
    expected = F.scaled_dot_product_attention(
        *refs.values(), attn_mask=mask, scale=8**-0.5, enable_gqa=True
    ).transpose(1, 2)
    expected.backward(grad_out.float())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected.bfloat16())
    for name, leaf in leaves.items():
        assert leaf.grad.dtype == dtype
        assert torch.equal(leaf.grad, refs[name].grad.to(dtype)), name

    # A pass without gradients (a learner's scoring) attends the same way: the same bits.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        scored, _ = gqa_attention(
            Layer(), *(t.detach() for t in leaves.values()), mask, scaling=8**-0.5
        )
    assert torch.equal(scored, out.detach())


def test_the_attentions_projections_keep_one_cast_of_their_shared_input():
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)
    ids = torch.randint(0, len(tokenizer), (2, 7), generator=torch.Generator().manual_seed(3))
    hidden, tokens = model.config.hidden_size, ids.numel()

    def kept_bytes(cast_once: bool):
        def run(seen):
            seen.update(p.untyped_storage().data_ptr() for p in model.parameters())
            with torch.autocast("cpu", dtype=torch.bfloat16), lean_layers(model, True):
                model(input_ids=ids).logits.float().sum().backward()

        if cast_once:
            return saved_bytes(run)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(lean_layers_module, "_cast_input", lambda x, dtype: x.to(dtype))
            return saved_bytes(run)

    # Each layer's query, key and value projections read one normed input: one bfloat16 copy
    # kept for their backward instead of three.
    fewer = kept_bytes(False) - kept_bytes(True)
    assert fewer == 2 * 2 * tokens * hidden * model.config.num_hidden_layers


def test_an_input_changed_in_place_is_cast_again():
    x = torch.randn(3, 4)
    first = lean_layers_module._cast_input(x, torch.bfloat16)
    assert lean_layers_module._cast_input(x, torch.bfloat16) is first
    x.mul_(2)
    again = lean_layers_module._cast_input(x, torch.bfloat16)
    assert again is not first
    assert torch.equal(again, x.to(torch.bfloat16))
    assert lean_layers_module._cast_input(x.clone(), torch.bfloat16) is not again


def test_a_bfloat16_share_over_few_tokens_is_added_in_float32_by_the_product_itself():
    from palaestra.models.lean_layers import WIDE_SHARE_ROWS, _add_weight_grad

    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(48, 32, generator=generator))
    start = torch.randn(48, 32, generator=generator)
    errors = {}
    for rows in (WIDE_SHARE_ROWS, WIDE_SHARE_ROWS + 1):
        dy = torch.randn(rows, 48, generator=generator).bfloat16()
        x = torch.randn(rows, 32, generator=generator).bfloat16()
        weight.grad = start.clone()
        _add_weight_grad(weight, dy, x)
        assert weight.grad.dtype == torch.float32
        exact = start.double() + dy.double().T @ x.double()
        errors[rows] = float((weight.grad.double() - exact).abs().max())
    # Up to WIDE_SHARE_ROWS tokens the share is summed in float32 (errors of float32's
    # rounding); past it, the product is rounded to bfloat16 (8 bits) before the add.
    assert errors[WIDE_SHARE_ROWS] < 1e-5
    assert errors[WIDE_SHARE_ROWS + 1] > 1e-3
