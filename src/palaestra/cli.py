"""The ``palaestra`` command: train from a TOML file (or sweep a grid over it), list, inspect,
stop and export runs and groups, serve a model or a checkpoint, evaluate an endpoint, serve
the dashboard.

Each subcommand is a ``cmd_*`` function of the parsed arguments plus a few lines in
``build_parser``. Modules that load torch, pydantic or FastAPI are imported inside the
functions that need them, so ``palaestra --help`` starts in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

# Light: the run store's formatting and log readers load no torch, pydantic or FastAPI.
from palaestra.runs.directory import FINAL_STATES, STATES
from palaestra.runs.logs import last_lines, new_lines
from palaestra.runs.progress import duration as _duration
from palaestra.runs.progress import is_step_line, progress_line


class CommandError(Exception):
    """A user-facing failure: printed as one line, exit status 1, no traceback."""


# formatting ---------------------------------------------------------------------------------


def _when(timestamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp)) if timestamp else "-"


def _number(value: float | None, sign: bool = True) -> str:
    if value is None:
        return "-"
    return f"{value:+.3f}" if sign else f"{value:.3f}"


def _steps(run: dict) -> str:
    return f"{run['step']}/{run['total_steps']}" if run.get("total_steps") else str(run["step"])


def table(rows: list[list[str]], header: list[str], shrink: tuple[int, ...] = ()) -> str:
    """Left-aligned columns; when wider than the terminal, the ``shrink`` columns are cut
    (with an ellipsis) widest first, never the others (a run id must stay copyable)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    if not sys.stdout.isatty() and "COLUMNS" not in os.environ:
        shrink = ()  # piped into a file or another program: keep every character
    room = shutil.get_terminal_size().columns - 2 * (len(header) - 1)
    while sum(widths) > room and shrink:
        widest = max(shrink, key=lambda i: widths[i])
        if widths[widest] <= 8:
            break
        widths[widest] -= 1

    def cell(text: str, width: int) -> str:
        text = str(text)
        return text.ljust(width) if len(text) <= width else text[: width - 1] + "…"

    lines = ["  ".join(cell(c, w) for c, w in zip(row, widths, strict=True)) for row in [header]]
    lines += ["  ".join(cell(c, w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


# palaestra train ----------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    from palaestra.config_file import load_train_file
    from palaestra.rewards import RewardError

    config = load_train_file(args.file)
    if args.name:
        config = config.model_copy(update={"name": args.name})
    try:
        run = config.launch()
    except RewardError as error:  # a reward named in the file that does not import
        raise CommandError(f"{args.file}: [recipe] custom_rm_function: {error}") from None
    print(f"run id: {run.training_run_id}", flush=True)
    if args.detach:
        print(f"follow it with: palaestra run logs -f {run.training_run_id}")
        return 0
    try:
        return follow_training(run)
    except KeyboardInterrupt:
        print(f"\nstopping run {run.training_run_id} (checkpoints so far are kept) ...")
        run.stop()
        print(f"run {run.training_run_id}: {run.status}")
        return 130


def cmd_plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from palaestra.config_file import load_train_file
    from palaestra.plan import layout_of

    config = load_train_file(args.file)
    layout = None
    if args.learner_gpus or args.colocate or args.offload_optimizer:
        recipe = config.recipe
        layout = layout_of(recipe)
        if args.learner_gpus:
            gpus = max(recipe.rollout_num_gpus, args.learner_gpus)
            co = args.colocate
            engines = gpus if co else max(gpus - args.learner_gpus, 1)
            layout = replace(
                layout,
                device="cuda",
                learner_devices=args.learner_gpus,
                shard=args.learner_gpus,
                colocated=co,
                engines=engines,
                engine_devices=args.learner_gpus if co else engines,
                engines_sleep=co and layout.engine == "vllm",
            )
        layout = replace(layout, offload_optimizer=args.offload_optimizer)
    plan = config.plan(layout=layout, gpu=args.gpu, prompt_tokens=args.prompt_tokens)
    print(plan.table())
    return 0 if plan.fits else 1


def follow_training(run, poll_s: float = 0.3) -> int:
    """Print the run's log as it grows, with a progress line per step (in place of the
    training process's own step lines), until it ends."""
    log_offset, shown_steps, started = 0, 0, time.monotonic()
    first_step = None
    while True:
        info = run.status_info()  # read before the files, so nothing written before "done" is lost
        lines, log_offset = new_lines(run.path / "train.log", log_offset)
        for line in lines:
            if not is_step_line(line):
                print(line, flush=True)
        metrics = run.metrics()
        if first_step is None and info.get("total_steps"):
            first_step = info.get("first_step") or 0
            started = time.monotonic()
        for row in metrics[shown_steps:]:
            print(progress_line(row, info.get("total_steps"), first_step or 0, started), flush=True)
        shown_steps = len(metrics)
        if info["state"] in FINAL_STATES:
            break
        time.sleep(poll_s)
    state = info["state"]
    if state == "completed":
        checkpoint = run.latest_checkpoint()
        print(f"completed {info.get('step')} steps; checkpoint: {checkpoint and checkpoint.path}")
        return 0
    if state == "failed":
        print(f"run {run.training_run_id} failed: {info.get('error')}", file=sys.stderr)
    else:
        print(f"run {run.training_run_id} was stopped at step {info.get('step')}", file=sys.stderr)
    return 1


# palaestra sweep ----------------------------------------------------------------------------


def parse_grid(items: list[str]) -> dict[str, list]:
    """``--grid recipe.lr=1e-6,1e-5`` (repeatable) as a grid. Each value is read as a TOML
    value (1e-6, 4, true, "text"), else taken as text (grpo)."""
    import tomllib

    grid: dict[str, list] = {}
    for item in items:
        field, sep, values = item.partition("=")
        if not sep or not field.strip() or not values.strip():
            raise CommandError(f"--grid {item!r}: expected FIELD=VALUE,VALUE (recipe.lr=1e-6,1e-5)")
        parsed = []
        for text in values.split(","):
            try:
                parsed.append(tomllib.loads(f"v = {text.strip()}")["v"])
            except tomllib.TOMLDecodeError:
                parsed.append(text.strip())
        grid[field.strip()] = parsed
    return grid


def cmd_sweep(args: argparse.Namespace) -> int:
    from palaestra.config_file import load_train_file
    from palaestra.launch.sweeps import TrainingGroup

    if not args.grid:
        raise CommandError("give at least one --grid FIELD=VALUE,VALUE")
    group = TrainingGroup(
        load_train_file(args.file),
        grid=parse_grid(args.grid),
        name=args.name,
        skip_invalid=args.skip_invalid,
    )
    for skipped in group.skipped:
        print(f"skipped {skipped['error']}")
    variants = list(group.iter_variants())
    print(f"group id: {group.group_id} ({len(variants)} variants)", flush=True)
    if args.detach:
        group.launch(max_parallel=args.max_parallel, continue_on_error=not args.stop_on_error)
        print(f"follow it with: palaestra group get {group.group_id}")
        return 0
    try:
        result = group.train(args.max_parallel, continue_on_error=not args.stop_on_error)
    except RuntimeError as error:  # the first failure, with --stop-on-error
        print(f"palaestra: {error}", file=sys.stderr)
        result = None
    print_group(group.group_id)
    return 0 if result is not None and not result.failed else 1


def print_group(group_id: str) -> None:
    from palaestra.runs.groups import group_detail

    detail = group_detail(group_id)
    axes = detail.get("axes", [])
    rows = [
        [v["run_id"], *[_value(v["overrides"].get(a)) for a in axes], v["state"],
         f"{v['step']}/{v['total_steps']}" if v.get("total_steps") else str(v["step"]),
         _number(v["final_reward"]), _number(v["best_reward"])]
        for v in detail["variants"]
    ]  # fmt: skip
    print(f"group {group_id} ({detail.get('name')}): {detail['state']}")
    print(table(rows, ["RUN", *axes, "STATUS", "STEP", "FINAL", "BEST"]))
    for skipped in detail.get("skipped", []):
        print(f"skipped: {skipped['error']}")


def _value(value) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def cmd_group_list(args: argparse.Namespace) -> int:
    from palaestra.runs.groups import list_groups

    found = list_groups()
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    if not found:
        print("no groups yet")
        return 0
    rows = [
        [g["group_id"], g["state"], ",".join(g["axes"]), str(g["variants"]),
         " ".join(f"{k}:{n}" for k, n in sorted(g["states"].items())),
         _number(g["best_reward"]), _when(g["created_at"])]
        for g in found
    ]  # fmt: skip
    header = ["GROUP", "STATUS", "GRID", "RUNS", "STATES", "BEST", "CREATED"]
    print(table(rows, header, shrink=(2,)))
    return 0


def cmd_group_get(args: argparse.Namespace) -> int:
    from palaestra.runs.groups import group_detail

    if args.json:
        print(json.dumps(group_detail(args.group_id), indent=2, default=str))
        return 0
    print_group(args.group_id)
    return 0


def cmd_group_stop(args: argparse.Namespace) -> int:
    from palaestra.launch.sweeps import GroupRun
    from palaestra.runs.groups import read_group

    read_group(args.group_id)  # KeyError naming an unknown group
    GroupRun(args.group_id).stop(timeout=args.timeout)
    print_group(args.group_id)
    return 0


# palaestra run ... --------------------------------------------------------------------------


def cmd_run_list(args: argparse.Namespace) -> int:
    from palaestra.runs.records import list_runs

    runs = list_runs(status=args.status, limit=args.limit, group=args.group)
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    if not runs:
        print(f"no {args.status} runs" if args.status else "no runs yet")
        return 0
    rows = [
        [
            r["run_id"],
            r["state"],
            r["model"],
            r["dataset"],
            _steps(r),
            _number(r["reward_mean"]),
            _when(r["started_at"] or r["created_at"]),
            _duration(r["duration_s"]),
        ]
        for r in runs
    ]
    header = ["RUN", "STATUS", "MODEL", "DATASET", "STEP", "REWARD", "STARTED", "DURATION"]
    print(table(rows, header, shrink=(2, 3)))
    return 0


def cmd_run_get(args: argparse.Namespace) -> int:
    from palaestra.runs.records import run_detail

    run = run_detail(args.run_id)
    if args.json:
        print(json.dumps(run, indent=2, default=str))
        return 0
    recipe = dict(run["config"].get("recipe") or {})
    reward = recipe.pop("custom_rm_function", None)
    preset = recipe.pop("class", "Recipe")
    lines = [
        ("run", run["run_id"]),
        ("status", f"{run['state']}, step {_steps(run)}"),
        ("error", run["error"]),
        ("group", _group_line(run)),
        ("backend", _backend_line(recipe)),
        ("model", run["model"]),
        ("dataset", run["dataset"]),
        ("reward", f"{_number(run['reward_mean'])} (mean of the latest step)"),
        ("reward fn", reward),
        ("started", _when(run["started_at"] or run["created_at"])),
        ("duration", _duration(run["duration_s"])),
        ("recipe", f"{preset}: " + " ".join(f"{k}={v}" for k, v in recipe.items())),
        ("log", run["log_path"]),
    ]
    width = max(len(k) for k, _ in lines)
    wrap = max(40, shutil.get_terminal_size().columns - width - 2)
    for key, value in lines:
        if value is not None:
            text = textwrap.fill(str(value), wrap, subsequent_indent=" " * (width + 2))
            print(f"{key.ljust(width)}  {text}")
    print("checkpoints" if run["checkpoints"] else "checkpoints  none")
    for checkpoint in run["checkpoints"]:
        print(f"  step {checkpoint['step']:<6} {checkpoint['path']}")
    for record in run["evals"]:
        print(f"eval {record['id']}: mean {_number(record.get('mean'))} over {record.get('total')}")
    for endpoint in run["endpoints"]:
        print(f"served at {endpoint['url']} ({endpoint['name']})")
    return 0


def _backend_line(recipe: dict) -> str | None:
    """Where a Ray run ran: its workers and cluster; nothing for the local backend."""
    if recipe.get("backend") != "ray":
        return None
    where = recipe.get("ray_address") or "a Ray instance of its own"
    return f"ray, {recipe.get('num_rollout_workers')} rollout worker(s) on {where}"


def _group_line(run: dict) -> str | None:
    """``GROUP_ID (recipe.lr=1e-05)``: the sweep a run is a variant of, and its grid values."""
    if not run.get("group_id"):
        return None
    overrides = run.get("group_overrides") or {}
    return f"{run['group_id']} ({', '.join(f'{k}={_value(v)}' for k, v in overrides.items())})"


def cmd_run_logs(args: argparse.Namespace) -> int:
    from palaestra.runs.registry import open_run

    run = open_run(args.run_id)
    # Whole lines only: a line still being written is printed once complete, by the follow.
    shown, offset = last_lines(run.log_path, args.lines, partial=False)
    for line in shown:
        print(line)
    sys.stdout.flush()
    if offset is None and not args.follow:
        print(f"(run {args.run_id} has no output yet)")
    while args.follow:
        done = run.read_status()["state"] in FINAL_STATES
        lines, offset = new_lines(run.log_path, offset or 0)
        for line in lines:
            print(line, flush=True)
        if done:
            break
        time.sleep(0.3)
    return 0


def cmd_run_stop(args: argparse.Namespace) -> int:
    from palaestra.launch.training import TrainingRun

    run = TrainingRun.from_id(args.run_id)
    before = run.status_info()
    if before["state"] in FINAL_STATES:
        print(f"run {args.run_id} is already {before['state']} (step {before.get('step')})")
        return 0
    run.stop(timeout=args.timeout)
    after = run.status_info()
    print(f"run {args.run_id}: {after['state']} at step {after.get('step')}")
    return 0


def cmd_run_trust(args: argparse.Namespace) -> int:
    from palaestra.runs.registry import runs_root
    from palaestra.runs.trust import trust

    pickled = runs_root() / args.run_id / "config.pkl"
    if not pickled.is_file():
        print(f"no run {args.run_id} with a config.pkl under {runs_root()}", file=sys.stderr)
        return 1
    trust(pickled)
    print(f"run {args.run_id}: its config.pkl is now trusted by this home; resume() will load it")
    return 0


def cmd_run_export(args: argparse.Namespace) -> int:
    from palaestra.runs.export import export_text

    text = export_text(args.run_id, args.format)
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        print(f"wrote {text.count(chr(10)) - (args.format == 'csv')} rows to {args.output}")
    return 0


# palaestra serve / eval / endpoint -----------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    import secrets

    from palaestra.serve import vllm_server
    from palaestra.serve.server import serve_in_foreground

    try:
        engine = vllm_server.choose_engine(args.engine)
    except ImportError as error:
        raise CommandError(str(error)) from None
    api_key = args.api_key
    if args.authenticated and api_key is None:
        api_key = f"pal-{secrets.token_urlsafe(24)}"
        print(f"API key: {api_key}")
    if engine == "vllm":
        return vllm_server.serve_in_foreground(
            args.target, args.host, args.port, args.name, api_key
        )
    serve_in_foreground(
        args.target,
        args.host,
        args.port,
        args.name,
        api_key,
        args.max_request_bytes,
        args.max_queued_requests,
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from palaestra.data import HuggingFaceDataset, LocalDataset, builtin_dataset
    from palaestra.evals import EvalConfig
    from palaestra.rewards import resolve_reward
    from palaestra.serve import Endpoint

    endpoint = Endpoint.get(args.endpoint)
    fields = {"input_column": args.input_column, "prompt_template": args.prompt_template}
    if args.system_prompt is not None:
        fields["system_prompt"] = args.system_prompt
    if args.output_column is not None:
        fields["output_column"] = args.output_column
    source = args.dataset
    if source.startswith("builtin:"):
        dataset = HuggingFaceDataset(
            hf_repo=str(builtin_dataset(source.removeprefix("builtin:"))),
            hf_split=args.split,
            **fields,
        )
    elif Path(source).expanduser().exists():
        dataset = LocalDataset(path=str(Path(source).expanduser()), hf_split=args.split, **fields)
    else:
        dataset = HuggingFaceDataset(hf_repo=source, hf_split=args.split, **fields)
    generate = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        generate["seed"] = args.seed
    score = resolve_reward(args.score)
    result = EvalConfig(dataset, eval_fn=score, generate_kwargs=generate).evaluate(
        endpoint, max_concurrency=args.concurrency
    )
    if args.json:
        print(json.dumps({"id": result.id, "mean": result.mean, "total": result.total}))
    else:
        print(f"mean {result.mean:+.3f} over {result.total} rows; saved as {result.path}")
    return 0


def cmd_endpoint_list(args: argparse.Namespace) -> int:
    from palaestra.runs.endpoints import list_endpoints

    endpoints = list_endpoints()
    if args.json:
        print(json.dumps(endpoints, indent=2))
        return 0
    rows = [
        [
            e["name"],
            e["url"] or "-",
            e["engine"],
            e["checkpoint"] or e["model"],
            _when(e["started_at"]),
        ]
        for e in endpoints
    ]
    print(
        table(rows, ["NAME", "URL", "ENGINE", "SERVES", "STARTED"], shrink=(3,))
        if rows
        else "no running endpoints"
    )
    return 0


def cmd_endpoint_stop(args: argparse.Namespace) -> int:
    from palaestra.serve import Endpoint

    Endpoint.get(args.name).stop()
    print(f"endpoint {args.name} stopped")
    return 0


# palaestra dashboard ------------------------------------------------------------------------


def cmd_dashboard(args: argparse.Namespace) -> int:
    from palaestra.dashboard.app import serve
    from palaestra.home import palaestra_home

    print(f"palaestra dashboard on http://{args.host}:{args.port} over {palaestra_home()}")
    print("press Ctrl-C to stop", flush=True)
    serve(host=args.host, port=args.port)
    return 0


# the parser ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="palaestra",
        description="RL post-training of language models with verifiable rewards.",
        epilog="State lives under $PALAESTRA_HOME (default ~/.palaestra).",
    )
    parser.add_argument("--version", action="version", version=f"palaestra {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    train = commands.add_parser("train", help="train from a TOML file, showing each step")
    train.add_argument("file", metavar="RECIPE.toml", help="model, dataset, recipe and reward")
    train.add_argument("--detach", action="store_true", help="start the run and return at once")
    train.add_argument("--name", help="prefix of the run id (overrides the file's name)")
    train.set_defaults(handler=cmd_train)

    plan = commands.add_parser(
        "plan", help="what a TOML file's run will hold per device, and a step's expected time"
    )
    plan.add_argument("file", metavar="RECIPE.toml", help="model, dataset, recipe and reward")
    plan.add_argument("--gpu", help="plan for this GPU (H100, H200, A100, L40S); default: this one")
    plan.add_argument("--prompt-tokens", type=int, help="prompt length (default: measured)")
    plan.add_argument(
        "--learner-gpus", type=int, help="what if: shard the learner over this many GPUs (FSDP2)"
    )
    plan.add_argument(
        "--colocate", action="store_true", help="what if: engines on the learner's GPUs"
    )
    plan.add_argument(
        "--offload-optimizer", action="store_true", help="what if: optimiser in host memory"
    )
    plan.set_defaults(handler=cmd_plan)

    run = commands.add_parser("run", help="list, inspect and stop runs")
    runs = run.add_subparsers(title="run commands", metavar="ACTION", required=True)
    listing = runs.add_parser("list", help="runs, newest first")
    listing.add_argument("--status", choices=STATES, help="only runs in this state")
    listing.add_argument("--limit", type=int, help="at most this many runs")
    listing.add_argument("--group", metavar="GROUP_ID", help="only the runs of this group")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(handler=cmd_run_list)
    get = runs.add_parser("get", help="one run: status, reward, recipe, checkpoints")
    get.add_argument("run_id", metavar="ID")
    get.add_argument("--json", action="store_true", help="print JSON")
    get.set_defaults(handler=cmd_run_get)
    logs = runs.add_parser("logs", help="a run's output")
    logs.add_argument("run_id", metavar="ID")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    logs.add_argument("-n", "--lines", type=int, default=200, help="last lines (default 200)")
    logs.set_defaults(handler=cmd_run_logs)
    stop = runs.add_parser("stop", help="stop a running run (its checkpoints are kept)")
    stop.add_argument("run_id", metavar="ID")
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds before forcing it")
    stop.set_defaults(handler=cmd_run_stop)
    trust = runs.add_parser(
        "trust", help="sign a run copied from elsewhere, so resuming it may run its code"
    )
    trust.add_argument("run_id", metavar="ID")
    trust.set_defaults(handler=cmd_run_trust)
    export = runs.add_parser("export", help="a run's (or a group's) metrics as CSV or JSON Lines")
    export.add_argument("run_id", metavar="ID", help="a run id or a group id")
    export.add_argument("--format", choices=("csv", "jsonl"), default="csv", help="default csv")
    export.add_argument("-o", "--output", help="write to this file (default: standard output)")
    export.set_defaults(handler=cmd_run_export)

    sweep = commands.add_parser("sweep", help="train every combination of a grid (a group)")
    sweep.add_argument("file", metavar="RECIPE.toml", help="the base: model, dataset, recipe")
    sweep.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="FIELD=V1,V2",
        help="a field and its values, e.g. recipe.lr=1e-6,1e-5 (repeat for more fields)",
    )
    sweep.add_argument("--name", help="the group's name (prefix of its id)")
    sweep.add_argument("--max-parallel", type=int, help="runs at once (default 1, see docs)")
    sweep.add_argument("--skip-invalid", action="store_true", help="skip bad combinations")
    sweep.add_argument("--stop-on-error", action="store_true", help="start no more after a failure")
    sweep.add_argument("--detach", action="store_true", help="start the group and return at once")
    sweep.set_defaults(handler=cmd_sweep)

    group = commands.add_parser("group", help="list, inspect and stop groups of runs (sweeps)")
    group_commands = group.add_subparsers(title="group commands", metavar="ACTION", required=True)
    group_list = group_commands.add_parser("list", help="groups, newest first")
    group_list.add_argument("--json", action="store_true", help="print JSON")
    group_list.set_defaults(handler=cmd_group_list)
    group_get = group_commands.add_parser("get", help="one group: its variants and rewards")
    group_get.add_argument("group_id", metavar="ID")
    group_get.add_argument("--json", action="store_true", help="print JSON")
    group_get.set_defaults(handler=cmd_group_get)
    group_stop = group_commands.add_parser("stop", help="stop a group and its running variants")
    group_stop.add_argument("group_id", metavar="ID")
    group_stop.add_argument("--timeout", type=float, default=60.0, help="seconds before forcing")
    group_stop.set_defaults(handler=cmd_group_stop)

    serve = commands.add_parser(
        "serve", help="serve a model or checkpoint over an OpenAI-compatible API (foreground)"
    )
    serve.add_argument(
        "target",
        metavar="MODEL_OR_CHECKPOINT",
        help="a checkpoint folder, a model folder, a catalogue name (SmolLM2-135M-Instruct) "
        "or a hub id",
    )
    serve.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine)")
    serve.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free one")
    serve.add_argument("--name", help="the model id clients ask for (default: from the target)")
    serve.add_argument("--api-key", help="require this key (Authorization: Bearer KEY)")
    serve.add_argument(
        "--authenticated", action="store_true", help="require a generated key, printed at start"
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="refuse request bodies over this size with 413 (default 4 MiB)",
    )
    serve.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests held at once before new ones get 503 + Retry-After (default 256)",
    )
    serve.add_argument(
        "--engine",
        choices=("auto", "torch", "vllm"),
        default="auto",
        help="torch: palaestra's server; vllm: vLLM's own (`vllm serve`, needs the vllm extra; "
        "the two limits above are the torch server's); auto (default): vllm on a CUDA machine "
        "that has it installed, else torch",
    )
    serve.set_defaults(handler=cmd_serve)

    evaluate = commands.add_parser("eval", help="score a running endpoint on a dataset")
    evaluate.add_argument("endpoint", metavar="ENDPOINT", help="a running endpoint's name")
    evaluate.add_argument(
        "--dataset",
        required=True,
        help="builtin:NAME (builtin:haiku), a local file or folder, or a hub id",
    )
    evaluate.add_argument("--split", default="test", help="split, with slicing (default test)")
    evaluate.add_argument("--input-column", default="input", help="column filling {input}")
    evaluate.add_argument("--output-column", help="the reference answer's column")
    evaluate.add_argument(
        "--prompt-template", default="{input}", help='e.g. "Write a haiku about {input}."'
    )
    evaluate.add_argument("--system-prompt", help="a system message before each prompt")
    evaluate.add_argument(
        "--score",
        required=True,
        metavar="MODULE:FUNCTION",
        help="scores the response text, e.g. palaestra.rewards.haiku:score_haiku",
    )
    evaluate.add_argument("--max-tokens", type=int, default=64, help="default 64")
    evaluate.add_argument("--temperature", type=float, default=1.0, help="default 1.0")
    evaluate.add_argument("--seed", type=int, help="sampling seed of every request")
    evaluate.add_argument("--concurrency", type=int, default=8, help="requests in flight (8)")
    evaluate.add_argument("--json", action="store_true", help="print JSON")
    evaluate.set_defaults(handler=cmd_eval)

    endpoint = commands.add_parser("endpoint", help="list and stop running endpoints")
    endpoints = endpoint.add_subparsers(title="endpoint commands", metavar="ACTION", required=True)
    endpoint_list = endpoints.add_parser("list", help="running endpoints, newest first")
    endpoint_list.add_argument("--json", action="store_true", help="print JSON")
    endpoint_list.set_defaults(handler=cmd_endpoint_list)
    endpoint_stop = endpoints.add_parser("stop", help="stop an endpoint")
    endpoint_stop.add_argument("name", metavar="NAME")
    endpoint_stop.set_defaults(handler=cmd_endpoint_stop)

    dashboard = commands.add_parser("dashboard", help="serve the web dashboard (read-only)")
    dashboard.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine)")
    dashboard.add_argument("--port", type=int, default=8765, help="default 8765")
    dashboard.set_defaults(handler=cmd_dashboard)
    return parser


def _version() -> str:
    from palaestra import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except CommandError as error:
        print(f"palaestra: {error}", file=sys.stderr)
        return 1
    except (KeyError, ValueError, FileNotFoundError) as error:
        if os.environ.get("PALAESTRA_DEBUG"):
            raise
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"palaestra: {message}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `palaestra run list | head`
        return 0
    except KeyboardInterrupt:  # Ctrl-C out of `run logs -f` or the dashboard
        return 130


if __name__ == "__main__":
    sys.exit(main())
