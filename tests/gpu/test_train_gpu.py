"""Training on a CUDA GPU: one step of the tiny model, its checkpoint loadable on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.support.tiny_runs import make_config


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_step_on_a_gpu(home, tiny_model_dir, prompts_file):
    result = make_config(tiny_model_dir, prompts_file, rollout_num_gpus=1).train()
    (metrics,) = result.metrics()
    assert metrics["reward_std"] > 0 and metrics["grad_norm"] > 0
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(result.latest_checkpoint().path)
