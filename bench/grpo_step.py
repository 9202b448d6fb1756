"""One GRPO step of palaestra against TRL's GRPOTrainer: same machine, model, data and config.

    pip install -e '.[bench]'        # TRL, pinned
    python bench/grpo_step.py [--steps 3] [--warmup 1] [--max-tokens 48] [--json results.json]
    python bench/grpo_step.py --smoke   # palaestra and TRL (where installed), one step of 2 x 2
                                        # samples of 8 tokens, small matmul peaks

A real run records its result under bench/results/grpo_step/ (``bench/results.py``).

A step is what both frameworks do for one optimiser update: sample ``--samples`` completions
(8) of each of ``--prompts`` prompts (4) with up to ``--max-tokens`` new tokens (48) at
temperature 1, top-p 1; score them with the haiku reward (``score_haiku``); turn the rewards
into group-std-scaled advantages; take one AdamW update (lr 1e-6, no KL, DAPO loss: token sum
over the step's response tokens / their count, grad-norm clip 1.0) over micro-batches of
``--micro-batch`` sequences (16). The model is the embedded SmolLM2-135M-Instruct with float32
weights, fully fine-tuned; palaestra computes in its recipe's default precision unless
``--precision`` (auto, float32, bfloat16) says otherwise; TRL runs twice, in float32 (its CPU
default, ``bf16=False``) and with ``bf16=True`` (side ``trl-bf16``), so the table compares like
with like whichever palaestra picks.
TRL runs with its gradient checkpointing off and a constant learning rate, as palaestra does
(its defaults are on and linear decay). Prompts are "Write a haiku about {keywords}." from
the built-in haiku train split through the model's chat template; palaestra's loop takes them
in its seeded shuffle and TRL, unshuffled, in that same order, so both sides take the same
prompts at each step.

palaestra's side is a real run: ``TrainConfig`` -> ``create_run`` -> ``train.loop.run_training``
on the local backend, the code a user's run executes, with the sampler wrapped only to hold
each step until the orchestrator says go.

The script is its own orchestrator: it measures the machine's matmul peak (float32 and
bfloat16), starts one worker process per framework (``--worker palaestra``, ``--worker trl``),
lets each load its model, then alternates single steps between them, so only one computes at a
time and neither shares the cores: ``--warmup`` untimed steps, then ``--steps`` timed ones.
It measures the peak again after the workers exit.

Each step reports: wall seconds (``step_s``), generation (``rollout_s``), reward scoring
(``reward_s``), and everything after the rewards (``train_s``: advantages, batch building,
forward and backward passes, optimiser step, weight sync); generated tokens (response tokens,
end-of-sequence included); trained tokens (prompt + response, padding excluded); mean reward;
the worker's peak RSS (VmHWM). From the sample lengths, ``flops.py`` gives each step's floor:
its FLOPs at the measured matmul peak of the precision each stage runs in. The summary is a
markdown table and a JSON object (also written to ``--json PATH``); worker logs go to
``--log-dir``.

TRL's timings come from inside its trainer: a callback marks each optimiser step (and holds
the worker before it until the orchestrator says go), and a thin subclass times ``_generate``.
TRL times generation itself, but reports it only to wandb, mlflow or trackio, not to its logs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import add_arguments, measure_peaks, record, skip, smoke_defaults

PROMPT = "Write a haiku about {keywords}."
SIDES = ("palaestra", "trl", "trl-bf16")
"""``trl-bf16`` is TRL with ``bf16=True``: its bfloat16 autocast, beside its float32 default."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (P)")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--max-tokens", type=int, default=48, help="most new tokens per sample")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per fwd/bwd pass")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--model", default="SmolLM2_135M", help="a palaestra catalogue name")
    parser.add_argument(
        "--precision",
        default=None,
        help="palaestra's Recipe.precision (auto, float32, bfloat16); default: the recipe's",
    )
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--sides", default="palaestra,trl,trl-bf16", help="which frameworks to run")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    parser.add_argument(
        "--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "palaestra-bench"
    )
    parser.add_argument("--worker", choices=SIDES, default=None, help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    smoke_defaults(
        args,
        parser,
        steps=1,
        warmup=0,
        prompts=2,
        samples=2,
        max_tokens=8,
        micro_batch=4,
        sides="palaestra,trl",
    )
    batch = args.prompts * args.samples
    if batch % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide prompts x samples = {batch}")
    unknown = set(args.sides.split(",")) - set(SIDES)
    if unknown:
        parser.error(f"--sides: unknown {', '.join(sorted(unknown))}; pick from {SIDES}")
    return args


# Worker side: both frameworks share these.


class Channel:
    """The worker's line protocol: commands in on stdin, JSON out on the original stdout.

    Everything else the worker (or a library) prints goes to stderr, so it cannot be mistaken
    for a report."""

    def __init__(self) -> None:
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def send(self, message: dict) -> None:
        self.out.write(json.dumps(message) + "\n")

    def wait_for_step(self) -> bool:
        """Block until the orchestrator says ``step`` (True) or ``quit`` / closes (False)."""
        return sys.stdin.readline().strip() == "step"


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def step_prompts(tokenizer, count: int) -> list[dict]:
    """The first ``count`` prompts the benchmark uses (cycling over the train split): chat
    messages, token ids through the chat template, and the row index."""
    from palaestra import builtin_dataset

    path = builtin_dataset("haiku") / "train.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = []
    for k in range(count):
        index = k % len(rows)
        messages = [{"role": "user", "content": PROMPT.format(keywords=rows[index]["keywords"])}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The chat template writes its own special tokens.
        ids = tokenizer(text, add_special_tokens=False).input_ids
        prompts.append({"index": index, "messages": messages, "text": text, "token_ids": ids})
    return prompts


def load(args):
    """Weights folder, tokenizer and float32 model, as palaestra loads them."""
    import torch

    import palaestra
    from palaestra.models.loading import load_causal_lm, load_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_config = getattr(palaestra, args.model)()
    weights = model_config.weights_path()
    tokenizer = load_tokenizer(weights, model_config.chat_template, model_config.revision)
    model = load_causal_lm(weights, torch.float32)
    return weights, tokenizer, model


def step_report(
    step_s: float,
    rollout_s: float,
    reward_s: float,
    sequences: list[tuple[int, int]],
    prompt_lengths: list[int],
    rewards: list[float],
    **extra,
) -> dict:
    """One step's numbers, in the same form from both workers. ``sequences`` holds each
    sample's (prompt tokens, response tokens); ``prompt_lengths`` each distinct prompt's."""
    import torch

    return {
        "step_s": step_s,
        "rollout_s": rollout_s,
        "reward_s": reward_s,
        "train_s": step_s - rollout_s - reward_s,
        "generated_tokens": sum(r for _, r in sequences),
        "trained_tokens": sum(p + r for p, r in sequences),
        "reward_mean": statistics.fmean(rewards),
        "peak_rss_mib": peak_rss_mib(),
        "threads": torch.get_num_threads(),
        "sequences": sequences,
        "prompt_lengths": prompt_lengths,
        **extra,
    }


def bench_prompts(tokenizer, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """The run's prompts in file order (palaestra's dataset), and the same prompts in the order
    palaestra's loop takes them from its seeded shuffle (what TRL gets, unshuffled), so both
    sides train on the same prompts at each step."""
    from palaestra.rollout.sampler import prompt_order

    count = (args.warmup + args.steps) * args.prompts
    prompts = step_prompts(tokenizer, count)
    return prompts, [prompts[i] for i in prompt_order(count, args.seed, 0, count)]


def haiku_reward(args, sample, **kwargs) -> float:
    from palaestra.rewards.haiku import score_haiku

    return score_haiku(sample.response)


class Lockstep:
    """The local backend's sampler, held before each step until the orchestrator says go; the
    step before is reported then (its metrics row is written by that time), the last one when
    the loop closes the sampler."""

    def __init__(self, inner, channel: Channel, run) -> None:
        self.inner, self.channel, self.run = inner, channel, run
        self.pending, self.waited = None, 0.0

    def sample(self, step: int, cursor: int):
        self.flush()
        waiting = time.perf_counter()
        if not self.channel.wait_for_step():
            raise SystemExit(0)
        # The loop times its step from before this call: the wait is not the step's.
        self.waited = time.perf_counter() - waiting
        self.pending = self.inner.sample(step, cursor)
        return self.pending

    def update_weights(self, weights, version: int) -> None:
        self.inner.update_weights(weights, version)

    def evaluate(self, step: int) -> dict:
        return self.inner.evaluate(step)

    def close(self) -> None:
        self.flush()
        self.inner.close()

    def flush(self) -> None:
        if self.pending is None:
            return
        samples, metrics = self.pending.samples_B, self.run.metrics()[-1]
        prompt_lengths = {s.index: len(s.prompt_token_ids) for s in samples}
        self.channel.send(
            step_report(
                # The step as the loop ran it, less the wait for the go and the checkpoint the
                # last step writes (TRL saves none).
                metrics["step_s"] - metrics["save_s"] - self.waited,
                metrics["rollout_s"],
                metrics["reward_s"],
                [(len(s.prompt_token_ids), len(s.response_token_ids)) for s in samples],
                list(prompt_lengths.values()),
                [s.reward for s in samples],
                loss=metrics["loss"],
                grad_norm=metrics["grad_norm"],
            )
        )
        self.pending = None


def palaestra_worker(args: argparse.Namespace, channel: Channel) -> None:
    """A palaestra run, trained by the same loop and local backend as any user's run."""
    import torch

    import palaestra
    from palaestra import LocalDataset, Recipe, TrainConfig
    from palaestra.backends.local import build_local
    from palaestra.launch.training import create_run
    from palaestra.train.loop import run_training

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    model = getattr(palaestra, args.model)()
    weights = model.weights_path()
    tokenizer = load_tokenizer_of(model)
    prompts, _ = bench_prompts(tokenizer, args)
    data = args.log_dir / "palaestra-prompts.jsonl"
    rows = [{"topic": p["messages"][-1]["content"]} for p in prompts]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    knobs = dict(
        num_rollout=args.warmup + args.steps,
        save_interval=None,
        rollout_batch_size=args.prompts,
        n_samples_per_prompt=args.samples,
        rollout_max_response_len=args.max_tokens,
        rollout_temperature=args.temperature,
        rollout_top_p=args.top_p,
        lr=args.lr,
        max_grad_norm=args.max_grad_norm,
        train_micro_batch_size=args.micro_batch,
        advantage_estimator="grpo",
        scale_rewards="group",
        loss_type="dapo",
        kl_loss_coef=0.0,
        num_steps_per_rollout=1,
        seed=args.seed,
        custom_rm_function=haiku_reward,
    )
    if args.precision is not None:
        knobs["precision"] = args.precision
    config = TrainConfig(
        model=model,
        dataset=LocalDataset(path=str(data), input_column="topic"),
        recipe=Recipe(**knobs),
        name="bench-grpo-step",
    )
    run = create_run(config)

    def backend(config, start):
        sampler, learner = build_local(config, start)
        engine = sampler.engine
        channel.send(
            {
                "ready": True,
                "load_s": time.perf_counter() - started,
                "weights": weights,
                "engine": type(engine).__name__,
                "run": str(run.path),
                "rollout_dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
                "train_dtype": str(learner.dtype).removeprefix("torch."),
                "recipe": config.recipe.to_json_dict(),
            }
        )
        return Lockstep(sampler, channel, run), learner

    try:
        run_training(config, run, backend)
    finally:
        # The figures went to the parent; the run's final checkpoint (1.6 GB for SmolLM2 with
        # its optimiser state) would otherwise pile up in the user's home, a record at a time.
        shutil.rmtree(run.path, ignore_errors=True)


def load_tokenizer_of(model):
    from palaestra.models.loading import load_tokenizer

    return load_tokenizer(model.weights_path(), model.chat_template, model.revision)


def trl_worker(args: argparse.Namespace, channel: Channel, bf16: bool = False) -> None:
    dtype = "bfloat16" if bf16 else "float32"  # what its autocast computes in
    import datasets
    import trl
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from palaestra.rewards.haiku import score_haiku

    started = time.perf_counter()
    weights, tokenizer, model = load(args)
    P, G = args.prompts, args.samples
    total = args.warmup + args.steps
    _, prompts = bench_prompts(tokenizer, args)
    prompt_tokens = {p["messages"][-1]["content"]: len(p["token_ids"]) for p in prompts}
    # Unshuffled, TRL's sampler takes rows k*P .. k*P + P - 1 for optimiser step k: in
    # palaestra's order, the same prompts palaestra's loop takes.
    dataset = datasets.Dataset.from_dict({"prompt": [p["messages"] for p in prompts]})
    current: dict = {}  # the step being measured

    def haiku(prompts, completions, completion_ids, **kwargs) -> list[float]:
        t0 = time.perf_counter()
        scores = [score_haiku(completion[0]["content"]) for completion in completions]
        current["reward_s"] += time.perf_counter() - t0
        current["rewards"] += scores
        current["sequences"] += [
            (prompt_tokens[prompt[-1]["content"]], len(ids))
            for prompt, ids in zip(prompts, completion_ids, strict=True)
        ]
        return scores

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                current["rollout_s"] += time.perf_counter() - t0

    class Lockstep(TrainerCallback):
        """Holds the trainer before each optimiser step until told to go, and reports the
        step at the next hold (so TRL's logging after a step finishes before palaestra's
        next step starts)."""

        def __init__(self) -> None:
            self.pending: dict | None = None

        def on_train_begin(self, train_args, state, control, **kwargs):
            channel.send(
                {
                    "ready": True,
                    "load_s": time.perf_counter() - started,
                    "weights": weights,
                    "trl": trl.__version__,
                    "rollout_dtype": dtype,
                    "train_dtype": dtype,
                    "optim": str(train_args.optim),
                    "steps_per_generation": train_args.steps_per_generation,
                    "generation_batch_size": train_args.generation_batch_size,
                    "gradient_checkpointing": train_args.gradient_checkpointing,
                }
            )

        def on_step_begin(self, train_args, state, control, **kwargs):
            self.flush()
            if not channel.wait_for_step():
                sys.exit(0)
            current.update(rollout_s=0.0, reward_s=0.0, rewards=[], sequences=[])
            current["tokens_seen"] = state.num_input_tokens_seen
            current["started"] = time.perf_counter()
            current["prompt_lengths"] = [
                len(p["token_ids"]) for p in prompts[state.global_step * P :][:P]
            ]

        def on_step_end(self, train_args, state, control, **kwargs):
            self.pending = step_report(
                time.perf_counter() - current["started"],
                current["rollout_s"],
                current["reward_s"],
                current["sequences"],
                current["prompt_lengths"],
                current["rewards"],
                # TRL's own count of the step's prompt + completion tokens, as a cross-check.
                trl_tokens_seen=state.num_input_tokens_seen - current["tokens_seen"],
            )

        def on_log(self, train_args, state, control, logs=None, **kwargs):
            # TRL's own timing of the step's forward/backward passes (generation included,
            # clipping and the optimiser step not), as a cross-check.
            if self.pending is not None and logs and "step_time" in logs:
                self.pending["trl_step_time"] = float(logs["step_time"])

        def on_train_end(self, train_args, state, control, **kwargs):
            self.flush()

        def flush(self):
            if self.pending is not None:
                channel.send(self.pending)
                self.pending = None

    config = GRPOConfig(
        output_dir=str(args.log_dir / f"{args.worker}-output"),
        use_cpu=True,
        bf16=bf16,
        # TRL defaults to recomputing activations in the backward pass; palaestra does not.
        gradient_checkpointing=False,
        per_device_train_batch_size=args.micro_batch,
        # One optimiser step = P x G sequences in micro-batches; TRL then generates once per
        # step (steps_per_generation defaults to gradient_accumulation_steps).
        gradient_accumulation_steps=P * G // args.micro_batch,
        num_generations=G,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        max_grad_norm=args.max_grad_norm,
        max_steps=total,
        shuffle_dataset=False,
        seed=args.seed,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=haiku,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Lockstep()],
    )
    trainer.train()


# Orchestrator side.


class Worker:
    """One framework's worker process, driven one step at a time."""

    def __init__(self, side: str, args: argparse.Namespace, env: dict[str, str]) -> None:
        self.side = side
        self.log_path = args.log_dir / f"{side}.log"
        self.log = self.log_path.open("w")
        command = [sys.executable, __file__, *sys.argv[1:], "--worker", side]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )

    def receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            tail = self.log_path.read_text().splitlines()[-30:]
            raise RuntimeError(
                f"the {self.side} worker exited (status {self.process.returncode}); "
                f"last lines of {self.log_path}:\n" + "\n".join(tail)
            )
        return json.loads(line)

    def step(self) -> dict:
        self.process.stdin.write("step\n")
        self.process.stdin.flush()
        return self.receive()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def without_missing_trl(args: argparse.Namespace) -> str | None:
    """``args.sides`` less the TRL sides when TRL is not installed (a smoke run skips them,
    one line each); None when a real run asks for them without TRL."""
    import importlib.util

    sides = args.sides.split(",")
    missing = [s for s in sides if s.startswith("trl")]
    if not missing or importlib.util.find_spec("trl") is not None:
        return args.sides
    if not args.smoke:
        return None
    for side in missing:
        skip(side, "TRL is not installed: pip install -e '.[bench]'")
    return ",".join(s for s in sides if s not in missing)


def summarise(side: str, ready: dict, reports: list[dict], shape, peaks: dict) -> dict:
    """Means, medians, throughput and floor of one side's timed steps."""
    from flops import step_flops

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in reports)

    steps = []
    for r in reports:
        flops = step_flops(shape, r["sequences"], r["prompt_lengths"])
        # A dtype without a measured peak (bfloat16 forced on a CPU that emulates it) has no
        # floor worth quoting.
        rollout_peak = peaks.get(ready["rollout_dtype"], math.nan)
        train_peak = peaks.get(ready["train_dtype"], math.nan)
        floor_s = flops["generate"] / (rollout_peak * 1e9) + flops["train"] / (train_peak * 1e9)
        row = {k: v for k, v in r.items() if k not in ("sequences", "prompt_lengths")}
        steps.append(row | {"gflops": flops["total"] / 1e9, "floor_s": floor_s})
    step_mean = mean("step_s")
    floor_mean = statistics.fmean(s["floor_s"] for s in steps)
    return {
        "side": side,
        "precision": f"{ready['rollout_dtype']} / {ready['train_dtype']}",
        "step_s_mean": step_mean,
        "step_s_median": statistics.median(r["step_s"] for r in reports),
        "rollout_s_mean": mean("rollout_s"),
        "reward_s_mean": mean("reward_s"),
        "train_s_mean": mean("train_s"),
        "generated_tokens_mean": mean("generated_tokens"),
        "trained_tokens_mean": mean("trained_tokens"),
        "generated_tokens_per_s": sum(r["generated_tokens"] for r in reports)
        / sum(r["rollout_s"] for r in reports),
        "reward_mean": mean("reward_mean"),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in reports),
        "gflops_mean": statistics.fmean(s["gflops"] for s in steps),
        "floor_s_mean": floor_mean,
        "step_over_floor": step_mean / floor_mean,
        "ready": ready,
        "steps": steps,
    }


ROWS = [
    ("precision (rollout / train)", "precision", "{}"),
    ("step s, mean", "step_s_mean", "{:.2f}"),
    ("step s, median", "step_s_median", "{:.2f}"),
    ("rollout s, mean", "rollout_s_mean", "{:.2f}"),
    ("reward s, mean", "reward_s_mean", "{:.3f}"),
    ("train s, mean", "train_s_mean", "{:.2f}"),
    ("generated tokens / step", "generated_tokens_mean", "{:.0f}"),
    ("generated tokens / s (rollout)", "generated_tokens_per_s", "{:.1f}"),
    ("trained tokens / step", "trained_tokens_mean", "{:.0f}"),
    ("reward, mean", "reward_mean", "{:+.2f}"),
    ("peak RSS MiB", "peak_rss_mib", "{:.0f}"),
    ("GFLOP / step", "gflops_mean", "{:.1f}"),
    ("floor s", "floor_s_mean", "{:.3f}"),
    ("step / floor", "step_over_floor", "{:.1f}"),
]


def markdown(results: dict) -> str:
    sides = [s for s in SIDES if s in results["sides"]]
    lines = [
        "| | " + " | ".join(sides) + " |",
        "|---|" + "---:|" * len(sides),
    ]
    for label, key, fmt in ROWS:
        cells = [fmt.format(results["sides"][s][key]) for s in sides]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    peaks = results["machine"]["matmul_gflops"]
    lines.append("")
    lines.append(
        "matmul peak GFLOP/s (before / after): "
        + ", ".join(
            f"{d} {peaks['before'][d]:.0f} / {peaks['after'][d]:.0f}" for d in peaks["used"]
        )
    )
    for side in ("trl", "trl-bf16"):
        if f"{side}_over_palaestra" in results:
            ratio = results[f"{side}_over_palaestra"]
            lines.append(
                f"{side} step / palaestra step: {ratio['mean']:.2f} (means), "
                f"{ratio['median']:.2f} (medians)"
            )
    return "\n".join(lines)


def orchestrate(args: argparse.Namespace) -> dict:
    sides = [s for s in SIDES if s in args.sides.split(",")]
    env = os.environ | {
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    os.environ.update(env)
    import torch
    import transformers
    from flops import ModelShape

    import palaestra

    torch.set_num_threads(args.threads)
    # Converts a GGUF once here, so the workers don't both try to.
    weights = getattr(palaestra, args.model)().weights_path()
    shape = ModelShape.from_config(transformers.AutoConfig.from_pretrained(weights))
    size = shape.intermediate
    print(f"measuring matmul peak ({size}x{size}, {args.threads} threads) ...", file=sys.stderr)
    before = measure_peaks(args.smoke, size)

    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"starting workers {sides}; logs in {args.log_dir}", file=sys.stderr)
    workers = {side: Worker(side, args, env) for side in sides}
    reports: dict[str, list[dict]] = {side: [] for side in sides}
    try:
        ready = {side: w.receive() for side, w in workers.items()}
        for k in range(args.warmup + args.steps):
            for side, worker in workers.items():
                report = worker.step()
                timed = k >= args.warmup
                print(
                    f"{side:>9} step {k + 1}{'' if timed else ' (warm-up)'}: "
                    f"{report['step_s']:.2f} s, {report['generated_tokens']} generated tokens",
                    file=sys.stderr,
                    flush=True,
                )
                if timed:
                    reports[side].append(report)
    finally:
        for worker in workers.values():
            worker.close()
    after = measure_peaks(args.smoke, size)
    peaks = {d: max(before[d], after[d]) for d in before}

    results = {
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("worker", "log_dir")
        },
        "machine": {
            "cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "model_shape": vars(shape) | {"matmul_params": shape.matmul_params},
            "matmul_size": size,
            "matmul_gflops": {"before": before, "after": after, "used": peaks},
        },
        "sides": {s: summarise(s, ready[s], reports[s], shape, peaks) for s in sides},
    }
    for side in ("trl", "trl-bf16"):
        if side in sides and "palaestra" in sides:
            theirs, ours = results["sides"][side], results["sides"]["palaestra"]
            results[f"{side}_over_palaestra"] = {
                "mean": theirs["step_s_mean"] / ours["step_s_mean"],
                "median": theirs["step_s_median"] / ours["step_s_median"],
            }
    return results


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        channel = Channel()
        if args.worker == "palaestra":
            palaestra_worker(args, channel)
        else:
            trl_worker(args, channel, bf16=args.worker == "trl-bf16")
        return
    sides = without_missing_trl(args)
    if sides is None:
        raise SystemExit(f"--sides {args.sides} needs TRL: pip install -e '.[bench]'")
    if not sides:
        raise SystemExit(f"--sides {args.sides}: nothing left to run here")
    args.sides = sides
    results = orchestrate(args)
    print(markdown(results))
    print()
    print(json.dumps(results, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    record(
        "grpo_step", args, results, headline(results), results["machine"]["matmul_gflops"]["used"]
    )


def headline(results: dict) -> dict:
    """palaestra's step and its distance from the floor; each TRL side's step over it (a side's
    own step where palaestra did not run)."""
    figures = {}
    for side, summary in results["sides"].items():
        if side != "palaestra" and "palaestra" in results["sides"]:
            continue
        figures[f"{side} step s"] = round(summary["step_s_mean"], 2)
        figures[f"{side} step / floor"] = round(summary["step_over_floor"], 2)
    for side in ("trl", "trl-bf16"):
        if f"{side}_over_palaestra" in results:
            figures[f"{side} / palaestra"] = round(results[f"{side}_over_palaestra"]["mean"], 2)
    return figures


if __name__ == "__main__":
    main()
