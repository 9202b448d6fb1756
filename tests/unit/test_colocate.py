"""The colocated layout's parts that run in one process: the torch engine's sleep and wake, the
rehearsal switch (``PALAESTRA_DEVICE=cpu``) and where it is read, the colocated GPU layout, and
the checks that accept it or refuse what does not pair up."""

from __future__ import annotations

import pytest
import torch

from palaestra.devices import DEVICE_VAR, rehearsal_env, rehearsing, torch_device_type
from palaestra.engine import GenerationRequest, SamplingParams
from palaestra.engine.torch_engine import TorchEngine
from palaestra.launch.checks import COLOCATED_SHARE, colocated, gpu_layout, runtime_env_of
from palaestra.recipes import Recipe, RecipeNotRunnableError, check_gpus, check_sharding_runs
from tests.support.tiny_models import build_tiny_model, build_tokenizer

EIGHT = dict(rollout_num_gpus=8, actor_num_gpus_per_node=8, colocate=True)


def test_a_sleeping_torch_engine_frees_its_packed_weights_and_samples_alike_after_waking():
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)
    engine = TorchEngine(model, tokenizer, dtype=torch.bfloat16)  # a bf16 copy, packed once
    requests = [GenerationRequest([5, 6, 7], 2, SamplingParams(max_tokens=6, seed=3))]
    before = engine.generate_requests(requests)
    if engine._packed is None:
        pytest.skip("no packed generation pass on this CPU: nothing for sleep to drop")
    freed = engine.sleep()
    # The packed pass holds a bf16 copy of every linear layer's weight: the tiny model's
    # 21,600 linear weights x 2 bytes = 43,200 bytes at least (the embedding it shares with
    # the module is not counted: it stays).
    linear = sum(m.weight.numel() for m in engine.model.modules() if type(m) is torch.nn.Linear)
    assert linear == 21_600
    assert 43_200 <= freed < 43_200 + 1024
    assert engine._packed is None
    engine.wake()
    after = engine.generate_requests(requests)
    assert [c.token_ids for c in after[0]] == [c.token_ids for c in before[0]]
    assert engine.sleep() == freed  # packed again by the next pass, dropped again


def test_an_engine_asleep_without_its_weights_takes_them_back_whole_and_samples_alike():
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)
    engine = TorchEngine(model, tokenizer, dtype=torch.bfloat16)  # its own bf16 copy
    requests = [GenerationRequest([5, 6, 7], 2, SamplingParams(max_tokens=6, seed=3))]
    before = engine.generate_requests(requests)
    packed = engine.sleep()
    engine.generate_requests(requests)  # packed again
    # Every parameter once (the embedding is tied to the head), two bytes each, on top of
    # what the packed pass frees.
    params = sum(p.numel() for p in engine.model.parameters())
    assert engine.sleep(weights=True) == packed + 2 * params
    assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="dropped its weights while asleep"):
        engine.generate_requests(requests)
    weights = dict(model.named_parameters())
    name = next(iter(weights))
    with pytest.raises(KeyError, match=f"lack 1 of the parameters.*{name}"):
        engine.update_weights({k: v for k, v in weights.items() if k != name}, version=1)
    engine.update_weights(weights, version=1)
    held = dict(engine.model.named_parameters())
    assert all(torch.equal(held[k], v.to(torch.bfloat16)) for k, v in weights.items())
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    after = engine.generate_requests(requests)
    assert [c.token_ids for c in after[0]] == [c.token_ids for c in before[0]]


def test_an_engine_over_the_module_it_was_given_keeps_its_weights_asleep():
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)
    engine = TorchEngine(model, tokenizer)  # samples from the learner's own module
    assert engine.sleep(weights=True) == 0
    assert all(p.numel() > 0 for p in model.parameters())
    engine.generate_requests([GenerationRequest([5, 6], 1, SamplingParams(max_tokens=3))])


def test_a_float32_engine_over_its_own_module_has_nothing_to_free():
    tokenizer = build_tokenizer()
    engine = TorchEngine(build_tiny_model(tokenizer), tokenizer)
    engine.generate_requests([GenerationRequest([5, 6], 1, SamplingParams(max_tokens=3))])
    # The module it was given may be trained in place: its packed copy is dropped after each
    # call already, so sleeping frees nothing more.
    assert engine.sleep() == 0


def test_the_rehearsal_switch_turns_gpu_recipes_to_the_cpu(monkeypatch):
    monkeypatch.delenv(DEVICE_VAR, raising=False)
    assert (rehearsing(), torch_device_type(8), torch_device_type(0)) == (False, "cuda", "cpu")
    assert rehearsal_env() == {}
    monkeypatch.setenv(DEVICE_VAR, "cpu")
    assert (rehearsing(), torch_device_type(8)) == (True, "cpu")
    monkeypatch.setenv(DEVICE_VAR, "tpu")
    with pytest.raises(ValueError, match="PALAESTRA_DEVICE='tpu'"):
        rehearsing()


def test_the_switch_travels_in_the_jobs_runtime_env_beside_the_recipes(monkeypatch):
    recipe = Recipe(backend="ray", runtime_env={"env_vars": {"A": "1"}, "pip": ["x"]})
    monkeypatch.delenv(DEVICE_VAR, raising=False)
    assert runtime_env_of(recipe) == {"env_vars": {"A": "1"}, "pip": ["x"]}
    monkeypatch.setenv(DEVICE_VAR, "cpu")
    assert runtime_env_of(recipe) == {"env_vars": {"A": "1", DEVICE_VAR: "cpu"}, "pip": ["x"]}
    assert recipe.runtime_env == {"env_vars": {"A": "1"}, "pip": ["x"]}  # not modified


def test_device_of_and_the_gpu_check_follow_the_switch(monkeypatch):
    from types import SimpleNamespace

    from palaestra.backends.building import device_of

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # no GPU here
    config = SimpleNamespace(recipe=Recipe(backend="ray", **EIGHT))
    monkeypatch.delenv(DEVICE_VAR, raising=False)
    assert device_of(config) == "cuda"
    with pytest.raises(RecipeNotRunnableError, match="rollout_num_gpus=8"):
        check_gpus(config.recipe)
    monkeypatch.setenv(DEVICE_VAR, "cpu")
    assert device_of(config) == "cpu"
    check_gpus(config.recipe)  # the run's own Ray instance declares the 8 GPUs
    with pytest.raises(RecipeNotRunnableError, match="rollout_num_gpus=1"):
        check_gpus(Recipe(rollout_num_gpus=1))  # no Ray: nothing would declare it


def test_the_colocated_layout_pairs_a_rank_and_an_engine_on_each_gpu():
    recipe = Recipe(**EIGHT)
    assert colocated(recipe)
    layout = gpu_layout(recipe)
    # 8 bundles of one GPU: a rank's half and a worker's half each.
    assert (layout.learner, layout.workers, layout.per_worker) == (0.5, 8, 0.5)
    assert 8 * (COLOCATED_SHARE + COLOCATED_SHARE) == 8
    check_sharding_runs(recipe)  # runs now
    assert not colocated(Recipe(rollout_num_gpus=8))  # the split layout, as before
    assert gpu_layout(Recipe(rollout_num_gpus=8)).workers == 7


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(EIGHT, rollout_num_gpus=4),
            "rollout_num_gpus=4 must equal actor_num_gpus_per_node=8",
        ),
        (dict(EIGHT, num_rollout_workers=4), "num_rollout_workers=4 must be 8"),
        (dict(EIGHT, colocate=False), "colocate=False"),
        (dict(actor_num_gpus_per_node=2, colocate=True), "rollout_num_gpus=0 must equal"),
    ],
)
def test_layouts_that_do_not_pair_up_are_refused_naming_the_field(fields, message):
    with pytest.raises(RecipeNotRunnableError, match=message):
        check_sharding_runs(Recipe(**fields))
