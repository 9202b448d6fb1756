"""A multi-turn run's traces in the dashboard, in real headless Chromium: each sample shows as
a conversation, turn by turn, the model's turns marked as trained and the environment's not.
Skipped without Debian's chromium, as the other browser tests are."""

from __future__ import annotations

import shutil
import tempfile

from palaestra.runs.directory import read_jsonl
from tests.support.browser import FLAGS, browser_or_skip, screenshot, start_dashboard
from tests.support.episodes import LowercaseGame, episode_reward
from tests.support.tiny_runs import tiny_config, write_topics

CHROMIUM, sync_api = browser_or_skip()


def test_a_multi_turn_trace_reads_as_a_conversation(home, tiny_model_dir, tmp_path):
    data = write_topics(tmp_path / "topics.jsonl")
    config = tiny_config(
        tiny_model_dir,
        data,
        reward=episode_reward,
        environment=LowercaseGame,
        max_turns=2,
        num_rollout=1,
        rollout_max_response_len=6,
    )
    done = config.train()
    rows = sorted(
        read_jsonl(done.path / "samples.jsonl"), key=lambda r: (r["index"], r["group_index"])
    )
    server, url = start_dashboard(home)
    profile = tempfile.mkdtemp(prefix="palaestra-chromium-")
    try:
        with sync_api.sync_playwright() as playwright:
            context = playwright.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, headless=True, args=FLAGS
            )
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(f"{url}/runs/{done.training_run_id}")
            first = page.locator("table.traces tr.trace").first
            turns = first.locator(".conversation .turn")
            sync_api.expect(turns).to_have_count(3)
            shown = [
                (turns.nth(i).get_attribute("class"), turns.nth(i).locator("pre").text_content())
                for i in range(3)
            ]
            expected = [m for m in rows[0]["messages"] if "trained" in m]
            assert shown == [
                (f"turn {'trained' if m['trained'] else 'environment'}", m["content"])
                for m in expected
            ]
            assert [m["trained"] for m in expected] == [True, False, True]
            trained = sum(b - a for a, b in rows[0]["mask_spans"])
            summary = first.locator(".turn-summary").text_content()
            assert (
                summary
                == f"2 model turns, {trained} of {rows[0]['response_tokens']} tokens trained"
            )
            screenshot(page, "multiturn-traces.png")
            context.close()
            assert errors == []
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(profile, ignore_errors=True)
