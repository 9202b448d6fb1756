"""image_overlay on the Ray backend, on a local Ray instance: the driver (where the reward runs)
executes in the overlay environment, and so does every actor (``py_executable`` set to the
overlay's Python, built on the actor's node by a task placed there)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.support.tiny_runs import tiny_config, write_topics
from tests.support.wheels import write_wheel

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


async def probe_reward(args, sample, **kwargs) -> float:
    import overlay_ray_probe  # installed by the run's image_overlay only

    return float(overlay_ray_probe.VALUE)


def test_the_reward_in_the_driver_imports_what_the_overlay_installed(
    home, tiny_model_dir, tmp_path
):
    wheel = write_wheel(tmp_path, "overlay_ray_probe", 5)
    config = tiny_config(
        tiny_model_dir,
        write_topics(tmp_path / "topics.jsonl"),
        reward=probe_reward,
        num_rollout=1,
        backend="ray",
        image_overlay=lambda image: image.run_commands(f"pip install --no-index {wheel}"),
    )
    result = config.launch().result(timeout=600)
    run = home / "runs" / result.training_run_id
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["reward_mean"] == 5.0
    assert "image_overlay: built the environment at" in (run / "train.log").read_text()


def test_every_actor_runs_in_the_overlay(home, tiny_model_dir, tmp_path):
    from palaestra.backends.ray import build_ray
    from palaestra.train.state import Start, TrainerState

    wheel = write_wheel(tmp_path, "overlay_actor_probe", 9)
    config = tiny_config(
        tiny_model_dir,
        write_topics(tmp_path / "topics.jsonl"),
        backend="ray",
        num_rollout_workers=2,
        image_overlay=lambda image: image.env({"PROBE_MARK": "on"}).run_commands(
            f"uv pip install --system --no-index {wheel}"
        ),
    )
    if ray.is_initialized():
        ray.shutdown()
    sampler, learner = build_ray(config, Start(None, TrainerState(0, 1)))

    def inside(actor) -> tuple[str, int, str]:
        def probe(self):
            import overlay_actor_probe

            return sys.prefix, overlay_actor_probe.VALUE, os.environ.get("PROBE_MARK")

        return ray.get(actor.__ray_call__.remote(probe))

    try:
        (overlay,) = [p for p in (home / "overlays").iterdir() if p.is_symlink()]
        for actor in [learner.actor, *sampler.engine.workers]:
            prefix, value, mark = inside(actor)
            assert (os.path.realpath(prefix), value, mark) == (str(overlay.resolve()), 9, "on")
    finally:
        sampler.close()
        if ray.is_initialized():
            ray.shutdown()
