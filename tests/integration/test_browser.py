"""The dashboard in real headless Chromium, over real runs of the tiny model: what a person sees,
a group of runs (a sweep) and runs compared side by side included.

Needs Debian's ``chromium`` (``.ci/run`` installs it); skipped without it unless
PALAESTRA_REQUIRE_BROWSER is set. Playwright drives that binary; it never downloads a browser.
Screenshots go to $PALAESTRA_TEST_ARTIFACTS (default build/test-artifacts/).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from palaestra import RunFailedError
from palaestra.runs.compare import compare_runs
from palaestra.runs.directory import read_jsonl
from palaestra.runs.liveness import process_start_time
from palaestra.runs.registry import list_run_ids
from tests.support.browser import FLAGS, browser_or_skip, screenshot, start_dashboard
from tests.support.sweep_group import LABELS, make_group
from tests.support.tiny_runs import (
    count_lowercase,
    gate_path,
    gated_reward,
    tiny_config,
    write_topics,
)

CHROMIUM, sync_api = browser_or_skip()


async def nan_reward(args, sample, **kwargs) -> float:
    return float("nan")


def write_eval(home: Path, eval_id: str, run_id: str | None, mean: float) -> None:
    record = {
        "id": eval_id,
        "created_at": time.time(),
        "dataset": "topics.jsonl [train]",
        "endpoint": "tiny-ep",
        "model": "tiny",
        "checkpoint": None,
        "run_id": run_id,
        "step": 3 if run_id else None,
        "mean": mean,
        "total": 1,
        "rows": [{"prompt": "Say rain", "response": "<b>rain</b>", "score": mean}],
    }
    (home / "evals").mkdir(exist_ok=True)
    (home / "evals" / f"{eval_id}.json").write_text(json.dumps(record))


def write_endpoint(home: Path, run_id: str) -> None:
    """An endpoint record whose server is this test process, so it reads as running."""
    record = {
        "name": "tiny-ep",
        "url": "http://127.0.0.1:9999/v1",
        "host": "127.0.0.1",
        "port": 9999,
        "pid": os.getpid(),
        "pid_start": process_start_time(os.getpid()),
        "model": "tiny",
        "checkpoint": None,
        "run_id": run_id,
        "step": 3,
        "started_at": time.time(),
        "log": "/dev/null",
        "authenticated": False,
    }
    (home / "endpoints").mkdir(exist_ok=True)
    (home / "endpoints" / "tiny-ep.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_model_dir):
    """A failed run, a completed 3-step run with an eval, a launched run held at step 2, a base
    model eval, and `palaestra dashboard` over them."""
    home = tmp_path_factory.mktemp("browser") / "home"
    data = write_topics(home.parent / "topics.jsonl")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PALAESTRA_HOME", str(home))
        server, url = None, None
        # Both processes start while the other runs train here.
        live = tiny_config(tiny_model_dir, data, reward=gated_reward).launch()
        try:
            server, url = start_dashboard(home)
            with pytest.raises(RunFailedError):
                tiny_config(tiny_model_dir, data, reward=nan_reward, num_rollout=1).train()
            done = tiny_config(tiny_model_dir, data, reward=count_lowercase).train()
            write_eval(home, "ev-run", done.training_run_id, 2.75)
            write_eval(home, "ev-base", None, 1.25)
            write_endpoint(home, done.training_run_id)
            (failed_id,) = set(list_run_ids()) - {done.training_run_id, live.training_run_id}
            yield {"url": url, "home": home, "done": done, "live": live, "failed_id": failed_id}
        finally:
            live.stop(timeout=10)
            if server is not None:
                server.terminate()
                server.wait(timeout=10)


@pytest.fixture(scope="module")
def page(site):
    profile = tempfile.mkdtemp(prefix="palaestra-chromium-")
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
            viewport={"width": 1280, "height": 900},
        )
        errors: list[str] = []
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.set_default_timeout(20_000)
        yield page
        context.close()
    shutil.rmtree(profile, ignore_errors=True)
    assert errors == [], f"errors in the page's script: {errors}"


def test_runs_page_lists_runs_newest_first_with_evals(site, page):
    expect = sync_api.expect
    done, live = site["done"], site["live"]
    page.goto(site["url"] + "/")
    done_row = page.locator(f'#runs tr[data-run="{done.training_run_id}"]')
    expect(done_row).to_be_visible()
    expect(done_row.locator(".state")).to_have_text("completed")
    expect(done_row.locator("td").nth(4)).to_have_text("3 / 3")
    expect(page.locator(f'#runs tr[data-run="{live.training_run_id}"]')).to_be_visible()
    page.locator('.filters button[data-status="completed"]').click()
    expect(page.locator("#runs tr[data-run]")).to_have_count(1)
    expect(page.locator(f'#runs tr[data-run="{done.training_run_id}"]')).to_be_visible()
    page.locator('.filters button[data-status="running"]').click()
    expect(page.locator("#runs tr[data-run]")).to_have_count(1)
    expect(page.locator(f'#runs tr[data-run="{live.training_run_id}"]')).to_be_visible()
    page.locator('.filters button[data-status="all"]').click()
    expect(page.locator("#runs tr[data-run]")).to_have_count(3)
    order = [row.get_attribute("data-run") for row in page.locator("#runs tr[data-run]").all()]
    assert order == [done.training_run_id, site["failed_id"], live.training_run_id]  # newest first
    failed_row = page.locator(f'#runs tr[data-run="{site["failed_id"]}"]')
    expect(failed_row.locator(".state")).to_have_text("failed")
    # The completed run's eval shows in its row; the base model's eval in its own table.
    expect(done_row.locator("td").last).to_have_text("2.75")
    expect(page.locator("table.evals td.eval-mean")).to_have_text(["1.25"])
    expect(page.locator("table.endpoints td.endpoint-url")).to_have_text(
        ["http://127.0.0.1:9999/v1"]
    )
    screenshot(page, "runs-page.png")
    failed_row.locator("a").click()
    expect(page.locator("#run-error")).to_contain_text("must be finite")
    first_section = page.locator("main > div").nth(1)  # right below the run's header
    expect(first_section.locator("#run-error")).to_be_visible()


def test_run_page_charts_one_point_per_step_and_shows_traces(site, page):
    expect = sync_api.expect
    done = site["done"]
    page.goto(f"{site['url']}/runs/{done.training_run_id}")
    expect(page.locator("#step-count")).to_have_text("3 / 3")
    points = page.locator('figure[data-chart="reward"] g[data-series="reward_mean"] circle.point')
    expect(points).to_have_count(3)
    assert [points.nth(i).get_attribute("data-step") for i in range(3)] == ["1", "2", "3"]
    rewards = [float(points.nth(i).get_attribute("data-value")) for i in range(3)]
    assert rewards == pytest.approx([m["reward_mean"] for m in done.metrics()])
    # A plotted point sits inside the chart, not collapsed on an axis.
    box = points.nth(0).bounding_box()
    assert box is not None and box["width"] > 0

    page.select_option("#trace-step", "2")
    on_disk = sorted(
        (row for row in read_jsonl(done.path / "samples.jsonl") if row["step"] == 2),
        key=lambda row: (row["index"], row["group_index"]),
    )
    rows = page.locator("table.traces tr.trace")
    expect(rows).to_have_count(len(on_disk))
    expect(rows.first.locator("pre.response")).to_have_text(on_disk[0]["response"])
    assert rows.first.locator("pre.response").text_content() == on_disk[0]["response"]

    page.locator('th[data-sort="reward"]').click()
    shown = [float(text) for text in page.locator("table.traces td.reward").all_text_contents()]
    assert shown == sorted((row["reward"] for row in on_disk), reverse=True)
    expect(page.locator("#checkpoints")).to_contain_text(str(done.latest_checkpoint().path))
    expect(page.locator("table.evals td.eval-mean")).to_have_text(["2.75"])
    page.locator("table.evals a", has_text="rows").click()
    expect(page.locator("table.eval-rows pre.response:not(.prompt-text)").first).to_have_text(
        "<b>rain</b>"
    )
    screenshot(page, "run-page.png")


def test_a_running_run_updates_without_reloading(site, page):
    expect = sync_api.expect
    live = site["live"]
    page.goto(f"{site['url']}/runs/{live.training_run_id}")
    # The run waits at step 2 until the gate opens: the page shows step 1 and that it is live.
    expect(page.locator("#step-count")).to_have_text("1 / 3", timeout=120_000)
    expect(page.locator("#live")).to_be_visible()
    page.evaluate("window.notReloaded = true")
    gate_path().touch()
    expect(page.locator("#step-count")).to_have_text("3 / 3", timeout=120_000)
    expect(page.locator(".facts .state")).to_have_text("completed")
    assert page.evaluate("window.notReloaded") is True
    points = page.locator('figure[data-chart="reward"] g[data-series="reward_mean"] circle.point')
    expect(points).to_have_count(3)
    expect(page.locator("#log")).to_contain_text("step 3/3")
    expect(page.locator("#live")).to_be_hidden()
    screenshot(page, "live-run-page.png")


# Groups of runs and runs compared ---------------------------------------------------------

METRICS = "metrics.jsonl"


@pytest.fixture(scope="module")
def sweep_site(tmp_path_factory, tiny_model_dir):
    """A group of three variants, the last launched and held at step 2, a run outside the
    group, and `palaestra dashboard` over them: a home of their own."""
    home = tmp_path_factory.mktemp("sweep") / "home"
    with pytest.MonkeyPatch.context() as patch, ThreadPoolExecutor(1) as thread:
        patch.setenv("PALAESTRA_HOME", str(home))
        # Trained on a thread of its own: Playwright's sync API, once started, keeps an event
        # loop running on this one, where the trainer could not start its own.
        made = thread.submit(make_group, home, tiny_model_dir, live_last=True).result()
    server, url = start_dashboard(home)
    try:
        yield made | {"home": home, "url": url}
    finally:
        made["live"].stop(timeout=10)
        server.terminate()
        server.wait(timeout=10)


def shown(page, value: float) -> str:
    """``value`` as the page writes it; a page that lost the number fails the closeness check."""
    text = page.evaluate("(v) => fmt.num(v)", value)
    assert float(text) == pytest.approx(value, abs=5e-4)
    return text


def assert_overlay(page, home: Path, run_ids: list[str], labels: list[str]) -> None:
    """One line per run in the reward and loss charts, each point a metrics.jsonl row, and a
    legend naming each run by its label."""
    metrics = {run_id: read_jsonl(home / "runs" / run_id / METRICS) for run_id in run_ids}
    for chart, key in (("reward", "reward_mean"), ("loss", "loss")):
        figure = page.locator(f'#overlay figure[data-chart="{chart}"]')
        expect_series = [s.get_attribute("data-series") for s in figure.locator("g.series").all()]
        assert expect_series == run_ids
        for run_id in run_ids:
            rows = [row for row in metrics[run_id] if isinstance(row.get(key), int | float)]
            points = figure.locator(f'g[data-series="{run_id}"] circle.point')
            assert [int(p.get_attribute("data-step")) for p in points.all()] == [
                row["step"] for row in rows
            ]
            assert [float(p.get_attribute("data-value")) for p in points.all()] == [
                row[key] for row in rows
            ]
    # Lines of distinct colours, and the legend in the same order.
    colors = [
        page.locator(
            f'#overlay figure[data-chart="reward"] g[data-series="{r}"] path'
        ).get_attribute("stroke")
        for r in run_ids
    ]
    assert len(set(colors)) == len(run_ids)
    legend = page.locator("#overlay-legend span[data-run]")
    assert [s.get_attribute("data-run") for s in legend.all()] == run_ids
    assert legend.all_text_contents() == labels


def test_group_page_shows_variants_in_grid_order_and_follows_the_live_one(sweep_site, page):
    expect = sync_api.expect
    home, run_ids, live = sweep_site["home"], sweep_site["run_ids"], sweep_site["live"]
    page.goto(f"{sweep_site['url']}/groups/{sweep_site['group_id']}")
    expect(page.locator("h1")).to_have_text("lr-sweep")
    rows = page.locator("#variants tr[data-run]")
    expect(rows).to_have_count(3)
    assert [row.get_attribute("data-run") for row in rows.all()] == run_ids  # grid order
    live_row = page.locator(f'#variants tr[data-run="{live.training_run_id}"]')
    expect(live_row.locator("td").nth(4)).to_have_text("1 / 2", timeout=120_000)
    expect(live_row.locator(".state")).to_have_text("running")
    expect(page.locator(".facts .state")).to_have_text("running")
    expect(page.locator("#live")).to_be_visible()
    # Overrides as columns, in the grid's order.
    overrides = [row.locator("td.override").all_text_contents() for row in rows.all()]
    assert overrides == [["0.01", "2"], ["0.01", "4"], ["0.001", "2"]]
    expect(page.locator("#skipped")).to_contain_text("not today")

    page.evaluate("window.notReloaded = true")
    (home / "gate-open").touch()
    expect(live_row.locator("td").nth(4)).to_have_text("2 / 2", timeout=120_000)
    expect(page.locator(".facts .state")).to_have_text("completed")
    expect(page.locator("#live")).to_be_hidden()
    assert page.evaluate("window.notReloaded") is True
    expect(page.locator('#overlay figure[data-chart="reward"] circle.point')).to_have_count(6)

    for run_id in run_ids:
        rewards = [
            row["reward_mean"] for row in read_jsonl(home / "runs" / run_id / "metrics.jsonl")
        ]
        row = page.locator(f'#variants tr[data-run="{run_id}"]')
        expect(row.locator("td.final-reward")).to_have_text(shown(page, rewards[-1]))
        expect(row.locator("td.best-reward")).to_have_text(shown(page, max(rewards)))
        expect(row.locator(".state")).to_have_text("completed")
    assert_overlay(page, home, run_ids, LABELS)
    eval_chart = page.locator('#overlay figure[data-chart="eval_reward_mean"]')
    expect(eval_chart.locator("g.series")).to_have_count(3)
    screenshot(page, "group-page.png")

    page.locator(f'#variants tr[data-run="{run_ids[0]}"] a').click()
    expect(page.locator("#run-group a")).to_have_text(sweep_site["group_id"])
    expect(page.locator("#run-group")).to_contain_text("recipe.lr=0.01")


def test_runs_ticked_on_the_runs_list_open_overlaid(sweep_site, page):
    expect = sync_api.expect
    home, (first, second, _) = sweep_site["home"], sweep_site["run_ids"]
    chosen = [first, sweep_site["outside"], second]
    page.goto(sweep_site["url"] + "/")
    group_row = page.locator(f'#groups tr[data-group="{sweep_site["group_id"]}"]')
    expect(group_row.locator("a").first).to_have_text("lr-sweep")
    expect(page.locator("#compare-link")).to_have_text("Compare")
    for run_id in chosen:
        page.locator(f'input.select-run[data-run="{run_id}"]').check()
    expect(page.locator("#compare-link")).to_have_text("Compare 3 runs")
    expect(page.locator("#compare-bar")).to_contain_text("3 selected")
    screenshot(page, "runs-page-selected.png")
    page.locator("#compare-link").click()
    page.wait_for_url(f"**/compare?runs={','.join(chosen)}")
    expect(page.locator("#compare-runs tr[data-run]")).to_have_count(3)
    labels = [run["label"] for run in compare_runs(chosen, home)]
    assert "name=baseline" in labels[1] and "recipe.lr=0.005" in labels[1]
    assert_overlay(page, home, chosen, labels)
    # The run outside the group was never scored on an eval set: two eval lines, not three.
    eval_chart = page.locator('#overlay figure[data-chart="eval_reward_mean"]')
    assert [s.get_attribute("data-series") for s in eval_chart.locator("g.series").all()] == [
        first,
        second,
    ]
    for run_id in chosen:
        rewards = [
            row["reward_mean"] for row in read_jsonl(home / "runs" / run_id / "metrics.jsonl")
        ]
        row = page.locator(f'#compare-runs tr[data-run="{run_id}"]')
        expect(row.locator("td.final-reward")).to_have_text(shown(page, rewards[-1]))
        expect(row.locator("td.best-reward")).to_have_text(shown(page, max(rewards)))
    expect(page.locator("#live")).to_be_hidden()
    screenshot(page, "compare-page.png")
