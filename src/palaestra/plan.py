"""What a run will hold per device and how long a step should take, before any process starts.

``make_plan(recipe, shape, layout)`` adds up, per device, the bytes of each thing a run keeps:

- learner: float32 master weights, gradients (trained parameters only), AdamW's two float32
  moments (on the host when offloaded), the KL reference (a frozen float32 copy; none with
  LoRA, whose reference is the base with the adapters off), and the update's activations;
- engines: their weights in the sampling dtype (plus, for palaestra's engine on a CPU, the
  oneDNN-packed copy of its linear weights) and the KV cache (and linear-attention state) of
  the sequences in flight;
- the runtime: the process itself (interpreter and libraries on a CPU, the CUDA context on a
  GPU).

A learner sharded over N devices (FSDP2) divides its weights, gradients, optimiser and
reference by N. Terms are held *always*, *during the rollout* or *during the update*; a
device's peak is what is always held plus the larger of the two phases. Colocated engines
that sleep during the update (vLLM's sleep mode) hold their weights during the rollout only.

The step time is a floor at an assumed 40% of the device's peak FLOP/s (model FLOPs
utilisation): rollout ``2 * N * tokens`` per engine (or, when larger, one read of the engine's
weights per decoded token at the device's memory bandwidth), update ``6 * N * tokens`` over
the learner's devices plus ``2 * N * tokens`` per reference pass. CPU peaks are measured here
(a matmul, a copy); GPU peaks come from ``devices.GPUS``, the vendors' dense bfloat16
figures.

The layout is explicit (``Layout``), derived from the recipe by ``layout_of``, so a sharded
learner's fields plug in where they appear.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from palaestra.devices import Device, cpu_device, gpu_device
from palaestra.models.shape import ModelShape
from palaestra.recipes import Recipe

GIB = 1024**3
MFU = 0.40
"""The share of the device's peak FLOP/s a step's passes are assumed to reach."""
OVERRIDE_ENV = "PALAESTRA_SKIP_PLAN"
"""Set to 1 to launch a config the plan says does not fit (when the estimate is wrong)."""

CPU_RUNTIME_BYTES = 470 * 1024**2
"""A CPU run's process before its model loads: Python, torch, transformers, the tokenizer and
the prompts (461 and 478 MiB resident in two measurements for the embedded model's run,
``bench/plan_check.py --runtime``)."""
GPU_RUNTIME_BYTES = 1 * GIB
"""A GPU process's CUDA context, cuBLAS workspaces and allocator slack, per device."""
ACTIVATION_SCALE = {2: 1.18, 4: 1.04}
"""Measured over modelled saved-activation bytes (``activation_bytes``), by the compute
dtype's width: calibrated on the embedded model's shape with ``bench/plan_check.py
--activations`` (a token and layer: 19091 bytes measured under bfloat16 against 16128
modelled, 28673 under float32 against 27648)."""


def activation_bytes(shape: ModelShape, width: int) -> float:
    """Bytes the update's backward keeps per token and layer, with the lean SwiGLU and RMSNorm
    (``models.lean_layers``) and the residual stream in float32: the two norms' float32 inputs
    (8h), then in the compute dtype (``width`` bytes) their outputs, the queries and the
    attention's output, keys and values, and the MLP's gate and up (2h + 2Hd + 2KVd + 2i)."""
    h, i = shape.hidden, shape.intermediate
    attention = 2 * shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim
    modelled = 8 * h + width * (2 * h + attention + 2 * i)
    return ACTIVATION_SCALE[width] * modelled


@dataclass(frozen=True)
class Layout:
    """Where a run's parts live: the learner's devices and sharding, the engines', and
    whether they share devices."""

    device: str = "cpu"
    """``"cpu"`` or ``"cuda"``."""
    learner_devices: int = 1
    """Devices (or CPU processes) the learner's ranks occupy."""
    shard: int = 1
    """How many ways the learner's weights, gradients and optimiser are divided (FSDP2)."""
    engines: int = 1
    """Sampling engines; each holds a copy of the weights."""
    engine_devices: int = 1
    """Devices the engines occupy (colocated: the learner's)."""
    colocated: bool = True
    """Engines on the learner's devices (else on devices of their own)."""
    engines_sleep: bool = False
    """Colocated engines free their weights and cache while the learner updates (a
    synchronous local run's torch engine does too)."""
    offload_optimizer: bool = False
    """The optimiser's moments live in host memory."""
    engine: str = "torch"
    """``"torch"`` (palaestra's engine) or ``"vllm"``."""
    separate_engine_processes: bool = False
    """Engines in processes of their own (Ray workers), each with its own runtime."""


def layout_of(recipe: Recipe, engine: str | None = None) -> Layout:
    """The layout ``recipe`` describes: with more than one learner rank
    (``actor_num_gpus_per_node`` x ``actor_num_nodes``) the learner is sharded over them,
    ``colocate`` puts the engines on the same devices and ``optimizer_offload`` keeps the
    optimiser in host memory; else the learner is one rank on one device."""
    gpus = recipe.rollout_num_gpus
    per_node = recipe.actor_num_gpus_per_node
    nodes = recipe.actor_num_nodes
    colocate = recipe.colocate
    offload = recipe.optimizer_offload
    kind = engine or ("vllm" if gpus and recipe.rollout_engine != "torch" else "torch")
    if recipe.rollout_engine != "auto":
        kind = recipe.rollout_engine
    if recipe.learner_ranks > 1:
        learners = per_node * nodes
        co = colocate
        engines = gpus if gpus else recipe.num_rollout_workers
        return Layout(
            device="cuda" if gpus else "cpu",
            learner_devices=learners,
            shard=learners,
            engines=engines if co else max(gpus - learners, 1),
            engine_devices=learners if co else max(gpus - learners, 1),
            colocated=co,
            engines_sleep=co and kind == "vllm",
            offload_optimizer=offload,
            engine=kind,
            separate_engine_processes=recipe.backend == "ray" or gpus > 1,
        )
    if gpus > 1:
        # launch/checks.gpu_layout: one learner GPU, an engine on each of the others.
        return Layout("cuda", 1, 1, gpus - 1, gpus - 1, False, False, offload, kind, True)
    # A synchronous run's torch engine rests through each update: its packed weights and
    # its own copy of the policy go (backends.local.rests, TorchEngine.sleep).
    rests = not recipe.max_staleness and kind == "torch"
    if gpus == 1:
        return Layout("cuda", 1, 1, 1, 1, True, rests, offload, kind)
    if recipe.backend == "ray":
        workers = recipe.num_rollout_workers
        return Layout("cpu", 1, 1, workers, 1, True, False, offload, "torch", True)
    return Layout("cpu", engines_sleep=rests, offload_optimizer=offload)


@dataclass(frozen=True)
class Term:
    """One thing a device holds: its name, bytes, when (``always``, ``rollout``, ``update``)
    and the recipe fields that shrink it."""

    name: str
    bytes: int
    phase: str
    shrink: str = ""


@dataclass
class DeviceRow:
    """What one device (of ``count`` alike) holds."""

    role: str
    count: int
    capacity: int
    terms: list[Term] = field(default_factory=list)

    def phase_bytes(self, phase: str) -> int:
        return sum(t.bytes for t in self.terms if t.phase == phase)

    @property
    def peak(self) -> int:
        always = self.phase_bytes("always")
        return always + max(self.phase_bytes("rollout"), self.phase_bytes("update"))

    @property
    def fits(self) -> bool:
        """Whether the peak fits the capacity (a capacity of 0 is not known: not checked)."""
        return not self.capacity or self.peak <= self.capacity

    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)


@dataclass(frozen=True)
class Workload:
    """The token counts of one step, from the recipe and the prompts' length."""

    prompt_tokens: int
    """Tokens of the longest prompt (chat template included)."""
    sequences: int
    """Samples a step generates and trains on (P * G; P rows for SFT)."""
    groups: int
    response_tokens: int
    micro_batch: int

    @classmethod
    def of(cls, recipe: Recipe, prompt_tokens: int) -> Workload:
        sft = recipe.loss_type == "sft_loss"
        groups = recipe.rollout_batch_size
        sequences = groups * (1 if sft else recipe.n_samples_per_prompt)
        response = recipe.rollout_max_response_len
        if recipe.multi_turn and recipe.max_context_len:
            response = max(recipe.max_context_len - prompt_tokens, response)
        return cls(prompt_tokens, sequences, groups, response, recipe.train_micro_batch_size)

    @property
    def trained_tokens(self) -> int:
        return self.sequences * (self.prompt_tokens + self.response_tokens)

    @property
    def generated_tokens(self) -> int:
        return self.sequences * self.response_tokens

    def micro_batch_tokens(self, shared_prompt: bool, group_size: int) -> int:
        """Tokens through the model in one micro-batch. A group's prompt runs once when the
        model's attention allows it (``train.scoring``)."""
        rows = min(self.micro_batch, self.sequences)
        if shared_prompt and rows <= group_size:
            return self.prompt_tokens + rows * self.response_tokens
        return rows * (self.prompt_tokens + self.response_tokens)


@dataclass
class Plan:
    """Per-device memory, the step's expected seconds, and the checkpoints' bytes."""

    model: str
    shape: ModelShape
    layout: Layout
    workload: Workload
    rows: list[DeviceRow]
    device_name: str
    peak_flops: float
    bandwidth: float
    rollout_s: float
    update_s: float
    checkpoint_bytes: int
    optimizer_bytes: int
    kept_checkpoints: int | None
    prompt_assumed: bool = False
    """The prompts' length is ``DEFAULT_PROMPT_TOKENS``, not measured."""

    @property
    def fits(self) -> bool:
        return all(row.fits for row in self.rows)

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.update_s

    @property
    def disk_bytes(self) -> int | None:
        """Checkpoints on disk at most: the kept ones' weights and one optimiser state."""
        if self.kept_checkpoints is None:
            return None
        return self.kept_checkpoints * self.checkpoint_bytes + self.optimizer_bytes

    def table(self) -> str:
        return render(self)

    def __str__(self) -> str:
        return self.table()

    def refusal(self) -> str | None:
        """Why the run cannot fit, naming the largest term and the fields that shrink it;
        None when every device fits."""
        for row in self.rows:
            if not row.fits:
                term = row.largest()
                return (
                    f"the plan does not fit: each {row.role} device needs "
                    f"{gib(row.peak)} of its {gib(row.capacity)}; the largest term is "
                    f"{term.name} ({gib(term.bytes)}); what shrinks it: "
                    f"{term.shrink or 'nothing'}. Print the whole plan with TrainConfig.plan() "
                    "or `palaestra plan FILE`; "
                    f"if the estimate is wrong, set {OVERRIDE_ENV}=1 to launch anyway"
                )
        return None


def gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def make_plan(
    recipe: Recipe,
    shape: ModelShape,
    layout: Layout,
    device: Device,
    prompt_tokens: int,
    model_name: str = "model",
) -> Plan:
    """The plan of ``recipe`` for a model of ``shape`` laid out as ``layout`` on ``device``,
    with prompts of ``prompt_tokens`` tokens."""
    work = Workload.of(recipe, prompt_tokens)
    compute = 2 if resolves_bf16(recipe.precision, device) else 4
    learner = learner_terms(recipe, shape, layout, work, compute)
    engine = engine_terms(recipe, shape, layout, work, compute)
    rows = device_rows(layout, device, learner, engine)
    rollout_s, update_s = step_seconds(recipe, shape, layout, work, device, compute)
    trainable = shape.lora_params(recipe.lora_rank) if recipe.lora_rank else shape.params
    return Plan(
        model=model_name,
        shape=shape,
        layout=layout,
        workload=work,
        rows=rows,
        device_name=device.name,
        peak_flops=device.peak_flops,
        bandwidth=device.bandwidth,
        rollout_s=rollout_s,
        update_s=update_s,
        checkpoint_bytes=4 * trainable,
        optimizer_bytes=0 if getattr(recipe, "no_save_optim", False) else 8 * trainable,
        kept_checkpoints=kept_checkpoints(recipe),
    )


def resolves_bf16(precision: str, device: Device) -> bool:
    return precision == "bfloat16" or (precision == "auto" and device.bf16)


def learner_terms(
    recipe: Recipe, shape: ModelShape, layout: Layout, work: Workload, compute: int
) -> list[Term]:
    """What each learner device holds; its optimiser as a ``host`` term when offloaded."""
    n = layout.shard
    lora = shape.lora_params(recipe.lora_rank) if recipe.lora_rank else 0
    trainable = lora or shape.params
    shard = f"sharding the learner over more devices (actor_num_gpus_per_node; 1/{n} each now)"
    terms = [
        Term("learner weights (float32)", 4 * (shape.params + lora) // n, "always", shard),
        Term(
            "gradients (float32)",
            4 * trainable // n,
            "update",
            f"lora_rank > 0 (only adapters train) or {shard}",
        ),
        Term(
            "optimiser (AdamW, 2 x float32)",
            8 * trainable // n,
            "host" if layout.offload_optimizer else "always",
            f"offloading it to host memory, lora_rank > 0 or {shard}",
        ),
    ]
    if recipe.kl_loss_coef > 0 and not recipe.lora_rank:
        terms.append(
            Term(
                "KL reference (float32)",
                4 * shape.params // n,
                "always",
                "kl_loss_coef=0 (no reference) or lora_rank > 0 (the base is the reference)",
            )
        )
    shared = shape.attention_layers is None and recipe.n_samples_per_prompt > 1
    tokens = work.micro_batch_tokens(shared, recipe.n_samples_per_prompt)
    per_token = shape.layers * activation_bytes(shape, compute)
    terms.append(
        Term(
            f"activations ({tokens} tokens a micro-batch)",
            int(tokens * per_token),
            "update",
            "train_micro_batch_size (sequences a pass) or rollout_max_response_len",
        )
    )
    if compute == 2:
        # Autocast keeps a bfloat16 copy of each weight it multiplies until the backward; FSDP2
        # gathers the bfloat16 weights of about two blocks at a time instead.
        layer = (shape.matmul_params - shape.embedding_params) // shape.layers
        copies = 2 * (shape.matmul_params if n == 1 else 2 * layer + shape.embedding_params)
        terms.append(Term("bfloat16 weight copies", copies, "update", f"{shard}"))
    return terms


def engine_terms(
    recipe: Recipe, shape: ModelShape, layout: Layout, work: Workload, compute: int
) -> list[Term]:
    """What the engines on one engine device hold, together."""
    per_device = max(layout.engines // layout.engine_devices, 1)
    engine_bytes = 2 if layout.engine == "vllm" else compute
    own_copy = layout.engine == "vllm" or layout.separate_engine_processes or compute == 2
    phase = "rollout" if layout.engines_sleep else "always"
    terms = []
    if own_copy:
        name = f"engine weights ({'bfloat16' if engine_bytes == 2 else 'float32'})"
        weights = per_device * engine_bytes * shape.params
        if layout.separate_engine_processes and layout.engine == "torch":
            weights += per_device * 4 * shape.params  # a worker loads float32, then copies
        terms.append(Term(name, weights, phase, "engines on devices of their own"))
    if layout.device == "cpu" and layout.engine == "torch":
        terms.append(
            Term(
                "engine packed weights (oneDNN)",
                per_device * engine_bytes * shape.matmul_params,
                phase,
                "nothing (a CPU engine packs its weights once per version)",
            )
        )
    sequences = -(-work.sequences // layout.engines)
    if layout.engine == "torch":
        sequences = min(sequences, 64) + 1  # TorchEngine.max_batch rows, plus a scratch slot
    length = -(-(work.prompt_tokens + work.response_tokens) // 64) * 64
    kv = sequences * (length * shape.kv_bytes_per_token(engine_bytes))
    kv += sequences * shape.state_bytes_per_sequence()
    terms.append(
        Term(
            f"KV cache ({sequences} sequences x {length} tokens)",
            per_device * kv,
            "rollout",
            "rollout_max_response_len, n_samples_per_prompt or more engines",
        )
    )
    return terms


def device_rows(
    layout: Layout, device: Device, learner: list[Term], engine: list[Term]
) -> list[DeviceRow]:
    """The plan's rows: the devices of each role, and the host when something lives there."""
    host = [replace(t, phase="always") for t in learner if t.phase == "host"]
    learner = [t for t in learner if t.phase != "host"]
    if layout.device == "cpu":
        # One machine's memory holds every process: each learner rank's share (so the whole
        # learner, and a runtime per rank) and each engine worker's.
        ranks = layout.learner_devices
        learner = [replace(t, bytes=t.bytes * ranks) for t in learner]
        host = [replace(t, bytes=t.bytes * ranks) for t in host]
        processes = ranks + (layout.engines if layout.separate_engine_processes else 0)
        runtime = Term(
            f"runtime ({processes} process{'es' if processes > 1 else ''})",
            processes * CPU_RUNTIME_BYTES,
            "always",
            "",
        )
        scale = layout.engines if layout.separate_engine_processes else 1
        engine = [replace(t, bytes=t.bytes * scale) for t in engine]
        terms = [runtime, *learner, *host, *engine]
        return [DeviceRow("host (CPU)", 1, device.memory_bytes, terms)]
    context = Term("runtime (CUDA context)", GPU_RUNTIME_BYTES, "always", "")
    if layout.colocated:
        contexts = 2 if layout.separate_engine_processes or layout.engine == "vllm" else 1
        terms = [replace(context, bytes=contexts * GPU_RUNTIME_BYTES), *learner, *engine]
        rows = [
            DeviceRow("learner + engine GPU", layout.learner_devices, device.memory_bytes, terms)
        ]
    else:
        rows = [
            DeviceRow(
                "learner GPU", layout.learner_devices, device.memory_bytes, [context, *learner]
            ),
            DeviceRow("engine GPU", layout.engine_devices, device.memory_bytes, [context, *engine]),
        ]
    if host:
        total = [replace(t, bytes=t.bytes * layout.shard) for t in host]
        rows.append(DeviceRow("host (CPU), all ranks' offloaded state", 1, 0, total))
    return rows


def step_seconds(
    recipe: Recipe, shape: ModelShape, layout: Layout, work: Workload, device: Device, compute: int
) -> tuple[float, float]:
    """Rollout and update seconds at ``MFU`` of the device's peak (rollout: or the weights
    streamed once per decoded token at its bandwidth, when that takes longer)."""
    rate = device.peak_flops * MFU
    attention = 4 * shape.full_attention_layers * shape.heads * shape.head_dim
    context = work.prompt_tokens + work.response_tokens / 2
    per_token = 2 * shape.matmul_params + attention * context
    prefill = work.groups * work.prompt_tokens * (2 * shape.matmul_params)
    engines = max(layout.engines, 1)
    rollout_flops = (work.generated_tokens * per_token + prefill) / engines
    engine_bytes = 2 if layout.engine == "vllm" else compute
    streamed = work.response_tokens * engine_bytes * shape.params / device.bandwidth
    rollout_s = max(rollout_flops / rate, streamed)
    passes = 6.0 + (2.0 if recipe.kl_loss_coef > 0 else 0.0)
    trained = work.trained_tokens * (passes / 2) * per_token / layout.learner_devices
    return rollout_s, trained / rate


def kept_checkpoints(recipe: Recipe) -> int | None:
    """How many checkpoints a run keeps at most: ``save_total_limit``, or every one saved."""
    limit = getattr(recipe, "save_total_limit", None)
    interval = recipe.save_interval
    saves = 1 + (recipe.num_rollout // interval if interval else 0)
    if interval and recipe.num_rollout % interval == 0:
        saves -= 1  # the last step is a save step already
    return min(saves, limit) if limit else saves


def render(plan: Plan) -> str:
    """The plan as a plain-text table: one block per device role, then the step and disk."""
    s = plan.shape
    lay = plan.layout
    w = plan.workload
    lines = [
        f"plan: {plan.model} ({s.params / 1e9:.2f}B parameters, {s.layers} layers) on "
        f"{plan.device_name}",
        f"layout: learner on {lay.learner_devices} {lay.device} device(s)"
        + (f", sharded {lay.shard} ways" if lay.shard > 1 else "")
        + f"; {lay.engines} {lay.engine} engine(s) "
        + ("on the learner's devices" if lay.colocated else f"on {lay.engine_devices} of their own")
        + (" (asleep during the update)" if lay.engines_sleep else "")
        + ("; optimiser offloaded to the host" if lay.offload_optimizer else ""),
        f"step: {w.sequences} sequences of up to {w.prompt_tokens} + {w.response_tokens} tokens, "
        f"micro-batches of {w.micro_batch}"
        + (" (prompt length assumed: no tokenizer here)" if plan.prompt_assumed else ""),
        "",
    ]
    for row in plan.rows:
        lines.append(f"{row.role} (x{row.count})")
        width = max(len(t.name) for t in row.terms)
        for term in row.terms:
            lines.append(f"  {term.name:<{width}}  {term.bytes / GIB:9.2f} GiB  {term.phase}")
        capacity = f" of {gib(row.capacity)}" if row.capacity else ""
        verdict = ("fits" if row.fits else "DOES NOT FIT") if row.capacity else "(not checked)"
        lines.append(f"  {'peak':<{width}}  {row.peak / GIB:9.2f} GiB{capacity}: {verdict}")
        lines.append("")
    lines.append(
        f"step time at {MFU:.0%} of {plan.peak_flops / 1e12:.1f} TFLOP/s "
        f"({plan.bandwidth / 1e9:.0f} GB/s): rollout {plan.rollout_s:.1f} s + update "
        f"{plan.update_s:.1f} s = {plan.step_s:.1f} s"
    )
    disk = plan.disk_bytes
    lines.append(
        f"checkpoints: {gib(plan.checkpoint_bytes)} weights each"
        + (
            f" + {gib(plan.optimizer_bytes)} optimiser (newest only)"
            if plan.optimizer_bytes
            else ""
        )
        + (f"; at most {plan.kept_checkpoints} kept: {gib(disk)} on disk" if disk else "")
    )
    return "\n".join(lines)


DEFAULT_PROMPT_TOKENS = 256
"""Prompt length assumed when the model's tokenizer is not on this machine to measure it."""


def plan_config(
    config,
    layout: Layout | None = None,
    gpu: str | None = None,
    prompt_tokens: int | None = None,
    measure: bool = True,
) -> Plan:
    """The plan of a TrainConfig: its model's shape (the catalogue's, or the config.json of
    a local model), the layout its recipe gets (or ``layout``), this machine's CPU or the GPU
    named ``gpu`` (default: this machine's, else an H100), and its prompts' length (measured
    with the model's tokenizer where it is local, else ``DEFAULT_PROMPT_TOKENS``). Without
    ``measure`` the CPU's rates are not measured (the memory is the same; the times are not
    meaningful)."""
    recipe = config.recipe
    layout = layout or layout_of(recipe)
    shape = model_shape(config.model)
    device = cpu_device(recipe.precision, measure) if layout.device == "cpu" else gpu_device(gpu)
    assumed = False
    if prompt_tokens is None:
        prompt_tokens = measured_prompt_tokens(config)
        assumed = prompt_tokens is None
    prompt_tokens = prompt_tokens or DEFAULT_PROMPT_TOKENS
    plan = make_plan(recipe, shape, layout, device, prompt_tokens, config.model.name)
    plan.prompt_assumed = assumed
    return plan


def model_shape(model) -> ModelShape:
    """``model``'s shape: the catalogue's hard-coded one, or its local config.json."""
    known = getattr(type(model), "shape", None)
    if isinstance(known, ModelShape):
        return known
    from pathlib import Path

    folder = Path(model.source).expanduser()
    if model.gguf_file is None and (folder / "config.json").is_file():
        return ModelShape.from_folder(folder)
    if model.gguf_file is not None:
        return ModelShape.from_folder(model.weights_path())
    raise ValueError(
        f"model {model.name!r}: its shape is not known offline (no config.json at "
        f"{model.source}); give a local HF-format folder or a catalogue model"
    )


def measured_prompt_tokens(config) -> int | None:
    """The longest prompt of the dataset in tokens, when the model's tokenizer is local."""
    from pathlib import Path

    model = config.model
    local = model.gguf_file is not None or (Path(model.source).expanduser() / "config.json")
    if local is not True and not (isinstance(local, Path) and local.is_file()):
        return None
    from palaestra.models.loading import load_tokenizer
    from palaestra.rollout.prompts import prepare_prompts

    tokenizer = load_tokenizer(model.weights_path(), model.chat_template, model.revision)
    kwargs = config.recipe.apply_chat_template_kwargs
    prompts = prepare_prompts(config.dataset, tokenizer, kwargs)
    return max((len(p.token_ids) for p in prompts), default=None)


def plan_check_skipped() -> bool:
    """Whether ``PALAESTRA_SKIP_PLAN`` turns the plan check off."""
    return os.environ.get(OVERRIDE_ENV, "") not in ("", "0")


def check_plan(config) -> Plan | None:
    """Refuse ``config`` before any process starts when its plan does not fit: a
    PlanDoesNotFitError naming the largest term. ``PALAESTRA_SKIP_PLAN=1`` skips the check;
    a model whose shape is unknown offline is not checked."""
    if plan_check_skipped():
        return None
    try:
        plan = plan_config(config, measure=False)
    except (ValueError, OSError, KeyError):
        return None  # no shape or tokenizer offline: nothing to check; the run finds out itself
    reason = plan.refusal()
    if reason is not None:
        raise PlanDoesNotFitError(reason)
    return plan


class PlanDoesNotFitError(ValueError):
    """The run's plan needs more memory than a device has."""
