"""Renders the benchmark results (bench/results/**.json) into the docs and the README.

    python bench/render.py            # rewrite docs/benchmarks.md and README.md's table
    python bench/render.py --check    # exit 1 if either is out of date (CI)

Two places, each between its markers, nothing else in the file touched:

- docs/benchmarks.md, between ``<!-- benchmarks:start -->`` and ``<!-- benchmarks:end -->``:
  per benchmark, the latest run on each CPU kind (AVX2-only, AVX-512 BF16, AMX) with its date,
  commit, CPU model and flags, matmul peak, headline figures and command; then every run, one
  row each, newest first.
- README.md, between ``<!-- results:start -->`` and ``<!-- results:end -->``: one table, one
  row per benchmark, its latest run.
- docs/benchmarks.md, between ``<!-- goals:start -->`` and ``<!-- goals:end -->`` where it has
  them: each speed goal (``GOALS``) against the latest run of its bench on each CPU kind.
- off-policy.md beside docs/benchmarks.md, between ``<!-- offpolicy:start -->`` and
  ``<!-- offpolicy:end -->``: every run of every ``offpolicy`` result, one row per backend,
  seed and staleness (left alone where that page does not exist).

Smoke runs (``"smoke": true``) are left out. The output depends on the result files only, so
rendering twice gives the same text and ``--check`` can compare.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from results import CPU_KINDS, FORMAT, REPO, RESULTS, cpu_kind

DOCS_MARKERS = ("<!-- benchmarks:start -->", "<!-- benchmarks:end -->")
README_MARKERS = ("<!-- results:start -->", "<!-- results:end -->")
OFFPOLICY_MARKERS = ("<!-- offpolicy:start -->", "<!-- offpolicy:end -->")
GOALS_MARKERS = ("<!-- goals:start -->", "<!-- goals:end -->")


@dataclass(frozen=True)
class Goal:
    """A goal: a headline figure of ``bench`` (or the ratio of two, or what a function reads
    from the whole record) ``sense`` (``<=`` or ``>=``) ``bound`` on each of ``kinds``."""

    name: str
    bench: str
    figure: str | tuple[str, str] | Callable[[dict], float | None]
    sense: str
    bound: float
    kinds: tuple[str, ...] = CPU_KINDS
    left: Callable[[dict, list[dict]], str | None] | None = None
    """Where the goal is not met, what the record (and the other records, oldest first) say is
    left, in numbers; None where they do not say."""

    def value(self, record: dict) -> float | None:
        if callable(self.figure):
            return self.figure(record)
        figures = record["headline"]
        top, bottom = self.figure if isinstance(self.figure, tuple) else (self.figure, None)
        if not figures.get(top) or (bottom is not None and not figures.get(bottom)):
            return None
        return figures[top] / (figures[bottom] if bottom else 1)

    def target(self) -> str:
        return f"{'at most' if self.sense == '<=' else 'at least'} {number(self.bound)}"

    def met(self, value: float) -> bool:
        return value <= self.bound if self.sense == "<=" else value >= self.bound


STEP, TRL, TRL_BF16 = "palaestra step / floor", "trl / palaestra", "trl-bf16 / palaestra"
ENGINE_F32 = ("engine-fp32 tokens/s", "vllm-float32 tokens/s")
ENGINE_BF16 = ("engine-bf16 tokens/s", "vllm-bfloat16 tokens/s")
AVX2, NATIVE_BF16 = ("AVX2-only",), ("AVX-512 BF16", "AMX")


def palaestra_peak_mib(record: dict) -> float | None:
    """The largest resident memory of palaestra's side of a ``grpo_step`` run."""
    side = record["figures"].get("sides", {}).get("palaestra") or {}
    return side.get("peak_rss_mib")


def step_parts(record: dict, records: list[dict]) -> str | None:
    """A ``grpo_step`` run's palaestra step: its rollout and update against their floors (the
    rollout's FLOPs taken as 2 x matmul parameters per generated token, the update's as the
    rest of the step's; both at the peak the step's floor used)."""
    side = record["figures"].get("sides", {}).get("palaestra") or {}
    shape = record["figures"].get("machine", {}).get("model_shape") or {}
    needed = ("gflops_mean", "floor_s_mean", "rollout_s_mean", "train_s_mean")
    if not all(side.get(key) for key in needed) or not shape.get("matmul_params"):
        return None
    peak = side["gflops_mean"] / side["floor_s_mean"]
    rollout_floor = 2 * shape["matmul_params"] * side["generated_tokens_mean"] / 1e9 / peak
    update_floor = side["floor_s_mean"] - rollout_floor
    rollout, update = side["rollout_s_mean"], side["train_s_mean"]
    return (
        f"rollout {rollout:.1f} s, {rollout / rollout_floor:.1f}x its floor; "
        f"update {update:.1f} s, {update / update_floor:.1f}x its floor"
    )


def update_parts(record: dict, records: list[dict]) -> str | None:
    """An ``update_profile`` run: the update against its floor, and its largest kinds of work."""
    figures = record["figures"]
    kinds = figures.get("kinds_s") or {}
    if not kinds or not figures.get("floor_s"):
        return None
    largest = sorted(kinds.items(), key=lambda item: -item[1])[:4]
    return (
        f"{figures['update_s']:.2f} s against a floor of {figures['floor_s']:.2f} s: "
        + ", ".join(f"{kind} {seconds:.2f} s" for kind, seconds in largest)
    )


def engine_parts(dtype: str) -> Callable[[dict, list[dict]], str | None]:
    """A ``generation`` run's engine in ``dtype`` against vLLM: the latest ``decode_pass`` run
    on the same CPU kind, in that dtype, at the workload's concurrency (its products and the
    rest), or that there is none."""

    mode = {"float32": "engine-fp32", "bfloat16": "engine-bf16"}[dtype]

    def parts(record: dict, records: list[dict]) -> str | None:
        rows = [r for r in record["figures"].get("results", []) if r.get("mode") == mode]
        if not rows:
            return None
        concurrency = rows[0]["concurrency"]
        passes = [
            r
            for r in records
            if r["bench"] == "decode_pass"
            and kind_of(r) == kind_of(record)
            and r["headline"].get("rows") == concurrency
            and r["headline"].get("dtype", "float32") == dtype
        ]
        if not passes:
            return (
                f"no `decode_pass --dtype {dtype}` run of {concurrency} rows on this CPU kind "
                "splits the pass"
            )
        figures = passes[-1]["headline"]
        reads = ""
        if "products GB/s" in figures:  # runs since the bench measured what bounds them
            reads = (
                f" (reading the weights at {figures['products GB/s']:.0f} GB/s where this "
                f"machine reads memory at {figures['memory GB/s']:.0f})"
            )
        return (
            f"a {dtype} decode pass of {concurrency} rows (`decode_pass` "
            f"{passes[-1]['time_utc'][:10]}): products {figures['products ms']:.0f} ms{reads}, "
            f"the rest {figures['rest ms']:.0f} ms"
        )

    return parts


def trl_parts(trl: str) -> Callable[[dict, list[dict]], str | None]:
    """A ``grpo_step`` run: TRL's side ``trl`` and palaestra's, each against its floor, and
    the ratio palaestra's step at its floor would give."""

    def parts(record: dict, records: list[dict]) -> str | None:
        sides = record["figures"].get("sides", {})
        theirs, ours = sides.get(trl) or {}, sides.get("palaestra") or {}
        if not theirs.get("step_over_floor") or not ours.get("floor_s_mean"):
            return None
        ceiling = theirs["step_s_mean"] / ours["floor_s_mean"]
        return (
            f"TRL {theirs['step_s_mean']:.1f} s, {theirs['step_over_floor']:.2f}x its floor; "
            f"palaestra {ours['step_s_mean']:.1f} s, {ours['step_over_floor']:.2f}x its floor; "
            f"at its floor palaestra would make it {ceiling:.2f}"
        )

    return parts


def tutorial_parts(record: dict, records: list[dict]) -> str | None:
    """A ``tutorial`` run: its training steps (rollouts, updates, saves) and what lies outside
    them, means over its runs, in minutes."""
    runs = record["figures"].get("runs") or []
    if not runs or any("steps s" not in run for run in runs):
        return None

    def minutes(key: str) -> float:
        return sum(run[key] for run in runs) / len(runs) / 60

    return (
        f"{runs[0]['steps']} steps {minutes('steps s'):.2f} min (rollouts "
        f"{minutes('rollout s'):.2f}, updates {minutes('update s'):.2f}, saves "
        f"{minutes('saves s'):.2f}); outside the steps {minutes('outside the steps s'):.2f} min "
        "(the endpoints' and training runs' starts, the evaluations)"
    )


def tutorial_scores(record: dict, records: list[dict]) -> str | None:
    """A ``tutorial`` run's scores, run by run: the base's and after 30 steps, with the
    three-line replies among the evaluated ones."""
    runs = record["figures"].get("runs") or []
    if not runs or any("after 30 steps replies" not in run for run in runs):
        return None
    return "; ".join(
        f"run {index}: {run['base model score']:+.2f} -> {run['after 30 steps score']:+.2f}, "
        f"{run['after 30 steps three_lines']} of {run['after 30 steps replies']} three lines"
        for index, run in enumerate(runs, 1)
    )


GOALS = [
    Goal("GRPO step / its floor", "grpo_step", STEP, "<=", 1.5, left=step_parts),
    Goal("update / its floor", "update_profile", "update / floor", "<=", 1.3, left=update_parts),
    Goal(
        "torch engine / vLLM CPU, float32",
        "generation",
        ENGINE_F32,
        ">=",
        1.0,
        left=engine_parts("float32"),
    ),
    Goal(
        "torch engine / vLLM CPU, bfloat16",
        "generation",
        ENGINE_BF16,
        ">=",
        1.0,
        NATIVE_BF16,
        engine_parts("bfloat16"),
    ),
    Goal("TRL float32 step / palaestra step", "grpo_step", TRL, ">=", 2.2, AVX2, trl_parts("trl")),
    Goal(
        "TRL float32 step / palaestra step",
        "grpo_step",
        TRL,
        ">=",
        4.0,
        NATIVE_BF16,
        trl_parts("trl"),
    ),
    Goal(
        "TRL bfloat16 step / palaestra step",
        "grpo_step",
        TRL_BF16,
        ">=",
        3.0,
        NATIVE_BF16,
        trl_parts("trl-bf16"),
    ),
    Goal("GRPO step, palaestra's peak resident MiB", "grpo_step", palaestra_peak_mib, "<=", 4140.0),
    Goal("tutorial (`make haiku`), minutes", "tutorial", "minutes", "<=", 5.0, left=tutorial_parts),
    Goal(
        "tutorial, points learned over the base",
        "tutorial",
        "points learned",
        ">=",
        4.0,
        left=tutorial_scores,
    ),
    Goal(
        "tutorial, three-line replies after 30 steps",
        "tutorial",
        "three-line share",
        ">=",
        0.8,
        left=tutorial_scores,
    ),
]
"""The goals the results are held against, each in the latest run of its bench on each CPU
kind. bfloat16 goals hold only where the CPU multiplies bfloat16 natively. The memory bound is
the step's peak when these goals were set (4140 MiB on an AVX-512 BF16 EPYC)."""


class RenderError(Exception):
    """A file the renderer cannot use: no markers, or a result it cannot read."""


def load_results(folder: Path) -> list[dict]:
    """Every non-smoke result under ``folder``, oldest first (ties: by bench, then path)."""
    records = []
    for path in sorted(Path(folder).glob("**/*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise RenderError(f"{path}: not a readable result ({error})") from error
        if record.get("format") != FORMAT:
            raise RenderError(f"{path}: result format {record.get('format')!r}, not {FORMAT}")
        if not record.get("smoke"):
            records.append(record | {"path": str(path)})
    return sorted(records, key=lambda r: (r["time_utc"], r["bench"], r["path"]))


def kind_of(record: dict) -> str:
    return cpu_kind(record["machine"]["cpu_flags"])


def latest(records: list[dict]) -> dict[str, dict[str, dict]]:
    """bench -> CPU kind -> its latest run (``records`` oldest first: later ones win)."""
    table: dict[str, dict[str, dict]] = {}
    for record in records:
        table.setdefault(record["bench"], {})[kind_of(record)] = record
    return table


def number(value: object) -> str:
    """A headline figure as a table shows it: three significant figures, whole numbers whole."""
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if value != value:  # NaN
        return "n/a"
    if abs(value) >= 1000 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.3g}"


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def commit_text(record: dict) -> str:
    return record["commit_short"] + (" (dirty)" if record.get("dirty") else "")


def flags_text(record: dict) -> str:
    flags = [name for name, present in record["machine"]["cpu_flags"].items() if present]
    return ", ".join(flags) or "none of avx2, avx512f, avx512_bf16, amx_bf16"


def peak_text(record: dict) -> str:
    peaks = record.get("matmul_gflops") or {}
    short = {"float32": "f32", "bfloat16": "bf16"}
    return ", ".join(f"{short.get(k, k)} {number(float(v))}" for k, v in peaks.items()) or "n/a"


def headline_text(record: dict) -> str:
    return "; ".join(f"{k} {number(v)}" for k, v in record.get("headline", {}).items())


def table(header: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines


def description(bench: str, bench_dir: Path) -> str:
    """The first line of ``bench_dir/<bench>.py``'s docstring, or nothing."""
    path = bench_dir / f"{bench}.py"
    if not path.is_file():
        return ""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    return docstring.strip().split("\n\n")[0].replace("\n", " ")


def bench_section(bench: str, kinds: dict[str, dict], runs: list[dict], bench_dir: Path) -> str:
    """One benchmark: its latest run per CPU kind, then all its runs, newest first."""
    shown = [kinds[k] for k in CPU_KINDS if k in kinds]
    keys = list(dict.fromkeys(k for r in shown for k in r.get("headline", {})))
    lines = [f"### {bench}", ""]
    about = description(bench, bench_dir)
    if about:
        lines += [about, ""]
    rows = [
        [kind_of(r), r["time_utc"][:10], commit_text(r), r["machine"]["cpu_model"], flags_text(r)]
        + [peak_text(r)]
        + [number(r.get("headline", {}).get(k, "")) for k in keys]
        + [f"`{r['command']}`"]
        for r in shown
    ]
    header = ["CPU kind", "date", "commit", "CPU", "flags", "matmul peak GFLOP/s"]
    lines += table(header + keys + ["command"], rows)
    lines += ["", "History, newest first:", ""]
    history = [
        [r["time_utc"].replace("T", " ").removesuffix("Z") + " UTC", commit_text(r)]
        + [kind_of(r), r["machine"]["cpu_model"], peak_text(r), headline_text(r)]
        for r in reversed(runs)
    ]
    lines += table(["time", "commit", "CPU kind", "CPU", "matmul peak GFLOP/s", "figures"], history)
    return "\n".join(lines)


def docs_body(records: list[dict], bench_dir: Path) -> str:
    if not records:
        return "No results yet: each bench's docstring gives the command that records one."
    sections = [
        bench_section(bench, kinds, [r for r in records if r["bench"] == bench], bench_dir)
        for bench, kinds in sorted(latest(records).items())
    ]
    return "\n\n".join(sections)


def readme_body(records: list[dict]) -> str:
    if not records:
        return "No benchmark results yet; see [docs/benchmarks.md](docs/benchmarks.md)."
    newest = {r["bench"]: r for r in records}  # oldest first: the newest run wins
    rows = [
        [f"`{bench}`", headline_text(r), r["time_utc"][:10], commit_text(r)]
        + [f"{r['machine']['cpu_model']} ({kind_of(r)}: {flags_text(r)})", peak_text(r)]
        for bench, r in sorted(newest.items())
    ]
    header = ["benchmark", "latest figures", "date", "commit", "CPU", "matmul peak GFLOP/s"]
    lines = table(header, rows)
    link = "[docs/benchmarks.md](docs/benchmarks.md)"
    lines += ["", f"Every run, per CPU kind, with its command: {link}."]
    return "\n".join(lines)


def offpolicy_body(records: list[dict]) -> str:
    """Each run of the ``offpolicy`` results: how far it learnt and how fast, by backend, seed
    and staleness."""
    rows = []
    for record in (r for r in records if r["bench"] == "offpolicy"):
        figures = record["figures"]
        for run in figures["runs"]:
            key = (figures["backend"], run["seed"], run["max_staleness"], record["time_utc"])
            rows.append(
                (
                    key,
                    [figures["backend"], run["seed"], run["max_staleness"]]
                    + [f"{run['test_score']:+.2f}", f"{run['three_lines_last5']:.0%}"]
                    + [number(run["steps_per_minute"]), number(run["median"]["step_s"])]
                    + [number(run["median"]["train_s"])]
                    + [f"{record['time_utc'][:10]} {commit_text(record)}", kind_of(record)],
                )
            )
    if not rows:
        return "No offpolicy results yet."
    header = ["backend", "seed", "max_staleness", "test score", "three lines (last 5 steps)"]
    header += ["steps/min", "median step s", "median update s", "run", "CPU kind"]
    return "\n".join(table(header, [row for _, row in sorted(rows, key=lambda r: r[0])]))


def goals_body(records: list[dict]) -> str:
    """Each speed goal against the latest run of its bench on each CPU kind that has one."""
    newest = latest(records)
    rows, left = [], []
    for goal in GOALS:
        for kind in goal.kinds:
            record = newest.get(goal.bench, {}).get(kind)
            value = None if record is None else goal.value(record)
            row = [goal.name, kind, goal.target()]
            if value is None:
                rows.append(row + ["not measured", "", ""])
                continue
            run = f"`{goal.bench}` {record['time_utc'][:10]} {commit_text(record)}"
            rows.append(row + [number(round(value, 2)), "yes" if goal.met(value) else "no", run])
            what = goal.left(record, records) if goal.left and not goal.met(value) else None
            if what:
                left.append(f"- {goal.name}, {kind} ({number(round(value, 2))}): {what}.")
    lines = table(["goal", "CPU kind", "target", "measured", "met", "run"], rows)
    if left:
        lines += ["", "What is left where a goal is not met, from the same runs:", "", *left]
    return "\n".join(lines)


def replace_between(text: str, markers: tuple[str, str], body: str, path: Path) -> str:
    """``text`` with what lies between ``markers`` replaced by ``body``."""
    start, end = markers
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise RenderError(f"{path}: needs one {start} line and, after it, one {end} line")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{body}\n{end}{tail}"


def render(results: Path, docs: Path, readme: Path, bench_dir: Path) -> dict[Path, str]:
    """The new text of ``docs`` and ``readme`` (each must exist and hold its markers; the goals'
    markers in ``docs`` are optional), and of the off-policy page beside ``docs`` where there
    is one."""
    records = load_results(results)
    parts = [
        (docs, DOCS_MARKERS, docs_body(records, bench_dir)),
        (readme, README_MARKERS, readme_body(records)),
    ]
    if docs.is_file() and GOALS_MARKERS[0] in docs.read_text():
        parts.append((docs, GOALS_MARKERS, goals_body(records)))
    offpolicy = docs.parent / "off-policy.md"
    if offpolicy.is_file():
        parts.append((offpolicy, OFFPOLICY_MARKERS, offpolicy_body(records)))
    rendered: dict[Path, str] = {}
    for path, markers, body in parts:
        if not path.is_file():
            raise RenderError(f"{path}: no such file (it needs {markers[0]} and {markers[1]})")
        text = rendered.get(path, path.read_text())
        rendered[path] = replace_between(text, markers, body, path)
    return rendered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    parser.add_argument("--readme", type=Path, default=REPO / "README.md")
    parser.add_argument("--bench-dir", type=Path, default=REPO / "bench", help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    try:
        rendered = render(args.results, args.docs, args.readme, args.bench_dir)
    except RenderError as error:
        print(f"render: {error}", file=sys.stderr)
        return 2
    stale = [path for path, text in rendered.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"render: {path} is out of date: run python bench/render.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(rendered[path])
        print(f"render: rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
