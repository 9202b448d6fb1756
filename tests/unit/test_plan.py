"""The plan's arithmetic on shapes small enough to work out by hand, the catalogue's shapes
against transformers' own parameter counts, the seed's recipe on 8 x 80 GB, and the refusal."""

from __future__ import annotations

import pytest
import torch

from palaestra import plan as planning
from palaestra.models.shape import ModelShape
from palaestra.plan import Device, Layout, make_plan
from palaestra.recipes import Qwen3_5_4B_Recipe, Recipe

# hidden 8, MLP 16, 2 layers, 2 query heads and 1 key/value head of 4, vocabulary 32, tied head.
TINY = ModelShape(
    hidden=8,
    intermediate=16,
    layers=2,
    heads=2,
    kv_heads=1,
    head_dim=4,
    vocab=32,
    tied_embeddings=True,
)


def test_a_tiny_shape_counts_its_parameters_by_hand_and_as_transformers_does():
    # embeddings 32 * 8 = 256; a layer: q 8*8 = 64, k and v 8*4 each = 64, o 8*8 = 64,
    # MLP 3 * 8 * 16 = 384, two norms of 8 = 16: 592; two layers 1184; final norm 8.
    assert TINY.params == 256 + 1184 + 8 == 1448
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    assert ModelShape.from_config(config) == TINY
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == TINY.params


@pytest.mark.parametrize("name", ["Qwen3_4B", "Qwen3_5_4B", "SmolLM2_135M"])
def test_catalogue_shapes_count_as_transformers_builds_them(name):
    """The hard-coded shapes are consistent with transformers' classes of the same numbers
    (the parameter counts in the catalogue's comments: 4,022,468,096 and 4,205,751,296)."""
    import transformers

    from palaestra.models import catalogue

    shape = getattr(catalogue, name).shape
    fields = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tied_embeddings,
    )
    if name == "Qwen3_5_4B":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        config = Qwen3_5TextConfig(
            **fields,
            linear_num_key_heads=shape.linear_key_heads,
            linear_num_value_heads=shape.linear_value_heads,
            linear_key_head_dim=shape.linear_key_dim,
            linear_value_head_dim=shape.linear_value_dim,
            linear_conv_kernel_dim=shape.linear_conv_kernel,
        )
        cls = Qwen3_5ForCausalLM
    elif name == "Qwen3_4B":
        config, cls = transformers.Qwen3Config(**fields), transformers.Qwen3ForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**fields), transformers.LlamaForCausalLM
    assert ModelShape.from_config(config) == shape
    with torch.device("meta"):
        model = cls(config)
    assert sum(p.numel() for p in model.parameters()) == shape.params
    expected = {"Qwen3_4B": 4_022_468_096, "Qwen3_5_4B": 4_205_751_296, "SmolLM2_135M": 134_515_008}
    assert shape.params == expected[name]


def tiny_plan(monkeypatch, capacity: int = 10**9, **recipe):
    monkeypatch.setattr(planning, "ACTIVATION_SCALE", {2: 1.0, 4: 1.0})
    monkeypatch.setattr(planning, "CPU_RUNTIME_BYTES", 1000)
    fields = dict(
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        rollout_max_response_len=4,
        train_micro_batch_size=2,
        precision="float32",
    )
    device = Device("test CPU", capacity, peak_flops=1e9, bandwidth=1e9, bf16=False)
    return make_plan(Recipe(**(fields | recipe)), TINY, Layout(), device, prompt_tokens=4)


def test_the_plan_adds_up_a_cpu_run_by_hand(monkeypatch):
    plan = tiny_plan(monkeypatch)
    (row,) = plan.rows
    terms = {t.name.split(" (")[0]: (t.bytes, t.phase) for t in row.terms}
    assert terms == {
        "runtime": (1000, "always"),
        "learner weights": (4 * 1448, "always"),  # 5792
        "gradients": (4 * 1448, "update"),
        "optimiser": (8 * 1448, "always"),  # two float32 moments: 11584
        # One group's prompt once (4 tokens) and its 2 responses of 4: 12 tokens, each saving
        # per layer 8 * 8 bytes of float32 norm inputs and 4 bytes x (2 * 8 norm outputs
        # + 2 * 2 * 4 queries and attention output + 2 * 1 * 4 keys and values + 2 * 16 gate
        # and up = 72) = 64 + 288 = 352 bytes; 2 layers: 704; 12 tokens: 8448.
        "activations": (8448, "update"),
        # float32 sampling: the engine samples from the learner's module, but packs its
        # linear weights (the tied head included: 1448 parameters) once more: 5792.
        "engine packed weights": (5792, "always"),
        # 4 sequences + a scratch slot, 64 positions (8 rounded up to a block), 2 layers x
        # keys and values x 1 head x 4 floats = 64 bytes a token: 5 * 64 * 64 = 20480.
        "KV cache": (20480, "rollout"),
    }
    # always 1000 + 5792 + 11584 + 5792 = 24168; the rollout's 20480 is more than the
    # update's 5792 + 8448 = 14240, so it decides the peak: 24168 + 20480 = 44648.
    assert row.peak == 44648
    assert plan.fits and plan.refusal() is None
    # Per generated token 2 * 1448 + attention 4 * 2 layers * 2 heads * 4 * 6 (mean context
    # 4 + 4 / 2) = 2896 + 384 = 3280 FLOPs; 16 generated: 52480, plus 2 prompts of 4 prefilled
    # at 2896: 23168; 75648 FLOPs at 40% of 1e9 FLOP/s = 1.8912e-4 s.
    assert plan.rollout_s == pytest.approx(75648 / 4e8)
    # 4 sequences of 8 tokens, forward and backward 3 x 3280 each: 314880 FLOPs.
    assert plan.update_s == pytest.approx(314880 / 4e8)
    assert (plan.checkpoint_bytes, plan.optimizer_bytes) == (5792, 11584)


def test_kl_lora_and_sharding_change_the_terms_they_should(monkeypatch):
    kl = {
        t.name.split(" (")[0]: t.bytes
        for t in tiny_plan(monkeypatch, kl_loss_coef=0.1).rows[0].terms
    }
    assert kl["KL reference"] == 4 * 1448  # a frozen float32 copy
    lora = tiny_plan(monkeypatch, lora_rank=2, kl_loss_coef=0.1)
    terms = {t.name.split(" (")[0]: t.bytes for t in lora.rows[0].terms}
    # Rank 2 on q (8 -> 8), k and v (8 -> 4), o (8 -> 8) and the MLP's gate, up (8 -> 16) and
    # down (16 -> 8): 2 x (16 + 12 + 12 + 16 + 24 + 24 + 24) = 256 a layer, 512 in all.
    assert TINY.lora_params(2) == 512
    assert terms["gradients"] == 4 * 512 and terms["optimiser"] == 8 * 512
    assert terms["learner weights"] == 4 * (1448 + 512)
    assert "KL reference" not in terms  # the base with the adapters off is the reference
    shape = Qwen3_5_4B_Recipe()
    sharded = make_plan(
        shape,
        TINY,
        Layout("cuda", 8, 8, 8, 8, True, True, True, "vllm"),
        planning.gpu_device("H100"),
        prompt_tokens=4,
    )
    gpu, host = sharded.rows
    names = {t.name.split(" (")[0]: t for t in gpu.terms}
    assert names["learner weights"].bytes == 4 * 1448 // 8
    assert names["engine weights"].phase == "rollout"  # asleep during the update
    assert "optimiser" not in names and host.terms[0].bytes == 8 * 1448 // 8 * 8


def test_the_seed_recipe_fits_8_h100s_sharded_and_colocated_not_on_one_learner_gpu():
    recipe = Qwen3_5_4B_Recipe()
    from palaestra.models.catalogue import Qwen3_5_4B

    h100 = planning.gpu_device("H100")
    one_learner_gpu = recipe.model_copy(
        update=dict(actor_num_gpus_per_node=1, colocate=False, optimizer_offload=False)
    )
    today = make_plan(recipe, Qwen3_5_4B.shape, planning.layout_of(one_learner_gpu), h100, 256)
    assert not today.fits
    assert "the largest term is" in today.refusal()
    sharded = Layout("cuda", 8, 8, 8, 8, True, True, True, "vllm", True)
    assert planning.layout_of(recipe) == sharded  # the preset's own layout
    planned = make_plan(recipe, Qwen3_5_4B.shape, sharded, h100, 256)
    assert planned.fits
    assert planned.rows[0].peak < 80 * 10**9


def test_a_config_that_cannot_fit_is_refused_before_a_run_exists(
    home, tiny_model_dir, prompts_file, monkeypatch
):
    import palaestra.devices
    from palaestra.plan import PlanDoesNotFitError
    from tests.support.tiny_runs import tiny_config

    monkeypatch.setattr(palaestra.devices, "host_memory", lambda: (10**6, 10**6))  # 1 MB
    config = tiny_config(tiny_model_dir, prompts_file)
    with pytest.raises(PlanDoesNotFitError) as refused:
        config.train()
    message = str(refused.value)
    # The process itself is the largest term of a 2-layer model's run; the message names it,
    # its bytes and the machine's.
    runtime = f"runtime (1 process) ({planning.CPU_RUNTIME_BYTES / 2**30:.2f} GiB)"
    assert f"the largest term is {runtime}" in message
    assert "0.00 GiB" in message and "PALAESTRA_SKIP_PLAN=1" in message
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())
    monkeypatch.setenv("PALAESTRA_SKIP_PLAN", "1")
    config.validate_here()  # the escape hatch: no refusal


def test_palaestra_plan_prints_the_table_of_a_toml_file(
    home, tiny_model_dir, prompts_file, tmp_path, capsys
):
    from palaestra.cli import main

    toml = tmp_path / "run.toml"
    toml.write_text(
        f'[model]\npath = "{tiny_model_dir}"\n'
        f'[dataset]\npath = "{prompts_file}"\ninput_column = "topic"\n'
        'prompt_template = "Say {input}"\n'
        '[recipe]\nprecision = "float32"\nsave_total_limit = 1\n'
        'custom_rm_function = "palaestra.rewards.haiku:haiku_reward"\n'
    )
    assert main(["plan", str(toml)]) == 0
    out = capsys.readouterr().out
    assert "host (CPU) (x1)" in out and "optimiser (AdamW, 2 x float32)" in out
    assert ": fits" in out and "at most 1 kept" in out
    # What if: a GPU layout the file does not ask for, named on the command line.
    assert main(["plan", str(toml), "--learner-gpus", "2", "--colocate", "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "learner + engine GPU (x2)" in out and "sharded 2 ways" in out
