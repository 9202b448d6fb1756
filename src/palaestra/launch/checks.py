"""What the Ray backend checks and prepares before any actor starts, without importing Ray
where it is not needed: the extra is installed, the cluster's address answers and has the GPUs
the recipe asks for, and the job's ``runtime_env``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from palaestra.recipes import Recipe, RecipeNotRunnableError, too_few_gpus

RAY_EXTRA = "backend='ray' needs Ray, which is not installed: pip install 'palaestra[ray]'"


@dataclass(frozen=True)
class GpuLayout:
    """The GPUs each actor of a run reserves in Ray's accounting."""

    learner: float
    workers: int
    per_worker: float


def gpu_layout(recipe: Recipe) -> GpuLayout:
    """Where ``recipe.rollout_num_gpus`` GPUs go: the learner trains on one GPU, and sampling
    takes the rest, one engine (vLLM on CUDA) per GPU.

    - 0: none, everything on CPUs.
    - 1: learner and rollout workers share the one GPU (half each in Ray's accounting; vLLM
      takes ``VLLM_GPU_SHARE`` of its memory, the learner the rest).
    - N > 1: one GPU for the learner, N - 1 for the rollout workers: by default one worker per
      GPU, each its own engine, so the tutorial's ``rollout_num_gpus=8`` samples on 7 GPUs
      while the 8th trains. Nothing is idle during sampling but the learner's GPU, and nothing
      pays vLLM's sleep and wake each step.
    - Colocated (``colocate=True``, the learner sharded over the same N GPUs): N bundles of one
      GPU, learner rank i and engine i in bundle i, ``COLOCATED_SHARE`` of it each (``learner``
      is then per rank). The engines sleep through the update (``backends.ray_sharded``).
    """
    n = recipe.rollout_num_gpus
    if colocated(recipe):
        # Learner rank i and engine i share GPU i: half of it each in Ray's accounting.
        return GpuLayout(COLOCATED_SHARE, n, COLOCATED_SHARE)
    chosen = "num_rollout_workers" in recipe.model_fields_set
    workers = recipe.num_rollout_workers if chosen or n <= 1 else n - 1
    if n == 0:
        return GpuLayout(0.0, workers, 0.0)
    if n == 1:
        return GpuLayout(0.5, workers, 0.5 / workers)
    per_worker = (n - 1) / workers
    if per_worker > 1:
        raise RecipeNotRunnableError(
            f"rollout_num_gpus={n} with num_rollout_workers={workers}: the learner takes one GPU "
            f"and each worker would take {per_worker:g} of the other {n - 1}, but an engine "
            f"samples on one GPU; set num_rollout_workers={n - 1} (or leave it unset)"
        )
    return GpuLayout(1.0, workers, per_worker)


COLOCATED_SHARE = 0.5
"""The GPU share each of a colocated bundle's two actors (a learner rank, an engine) reserves."""


def colocated(recipe: Recipe) -> bool:
    """Whether ``recipe`` runs the colocated layout: a sharded learner whose ranks share the
    engines' GPUs (``check_sharding_runs`` refuses the combinations that cannot)."""
    return recipe.colocate and recipe.learner_ranks > 1 and recipe.rollout_num_gpus > 0


def import_ray():
    """The ``ray`` module, or an error naming the extra that installs it."""
    try:
        import ray
    except ImportError as error:
        raise RecipeNotRunnableError(RAY_EXTRA) from error
    return ray


def check_ray_here(recipe: Recipe) -> None:
    """Fail in the caller's process, before a run starts, when the Ray backend cannot run
    ``recipe``: Ray missing, an address that does not answer, a cluster with fewer GPUs than
    ``rollout_num_gpus``."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise RecipeNotRunnableError(RAY_EXTRA)
    if recipe.ray_address not in (None, "auto"):
        check_address(recipe.ray_address)
    if recipe.ray_address is not None and recipe.rollout_num_gpus:
        found = cluster_gpus(recipe.ray_address)
        if recipe.rollout_num_gpus > found:
            raise too_few_gpus(recipe, found, f"the Ray cluster at {recipe.ray_address}")


def check_address(address: str, timeout_s: float = 3.0) -> None:
    """``address`` (``HOST:PORT``) accepts a TCP connection within ``timeout_s``, or a
    RecipeNotRunnableError names it. Ray itself would retry for a minute before giving up."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise RecipeNotRunnableError(
            f"ray_address={address!r} is not HOST:PORT (the head's address, e.g. "
            "'127.0.0.1:6379'), 'auto', or None for a Ray instance of the run's own"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as error:
        raise RecipeNotRunnableError(
            f"ray_address={address!r}: nothing answers there ({error}). Start the cluster's head "
            "with `ray start --head --port=PORT`, or set ray_address=None to start a Ray "
            "instance for this run"
        ) from None


CLUSTER_QUERY_TIMEOUT_S = 120.0

CLUSTER_QUERY = """
import logging, sys, ray
ray.init(address=sys.argv[1], logging_level=logging.WARNING, log_to_driver=False)
print(int(ray.cluster_resources().get("GPU", 0)), flush=True)
ray.shutdown()
"""


def cluster_gpus(address: str, timeout_s: float = CLUSTER_QUERY_TIMEOUT_S) -> int:
    """GPUs in the Ray cluster at ``address`` (``ray.cluster_resources()``). This process, when
    connected to Ray already, answers itself; otherwise a child process joins the cluster
    briefly and answers. Joining from this process would leave Ray's client state behind it,
    and a process that had run Ray instances of its own was seen to wait without end to join
    another cluster; the child also bounds the wait (``timeout_s``)."""
    import subprocess
    import sys

    ray = import_ray()
    if ray.is_initialized():
        return int(ray.cluster_resources().get("GPU", 0))
    if address != "auto":
        check_address(address)
    try:
        answer = subprocess.run(
            [sys.executable, "-c", CLUSTER_QUERY, address],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise RecipeNotRunnableError(
            f"ray_address={address!r}: joining the cluster to count its GPUs took over "
            f"{timeout_s:.0f} s; check that its head is healthy (`ray status --address "
            f"{address}`) and that this process has the cluster's token (RAY_AUTH_TOKEN)"
        ) from None
    lines = answer.stdout.split()
    if answer.returncode != 0 or not lines or not lines[-1].isdigit():
        raise RecipeNotRunnableError(
            f"ray_address={address!r}: could not count the cluster's GPUs: "
            f"{answer.stderr.strip()[-1500:] or answer.stdout.strip()[-500:]}"
        )
    return int(lines[-1])


def runtime_env_of(recipe: Recipe) -> dict[str, Any]:
    """The job's ``runtime_env``: ``recipe.runtime_env``, plus the rehearsal switch
    (``PALAESTRA_DEVICE``) when this process has it: actors take their environment from Ray's
    raylet, which a cluster started elsewhere never gave it. ``image_overlay`` is no part of it:
    its environment is built on each node and named per actor (``py_executable``), see
    ``backends.ray``."""
    from palaestra.devices import rehearsal_env

    env = dict(recipe.runtime_env or {})
    if rehearsal_env():
        env["env_vars"] = {**env.get("env_vars", {}), **rehearsal_env()}
    return env
