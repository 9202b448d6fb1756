"""The Ray backend: rollout workers and a learner as Ray actors; the loop stays in the driver.

- Each **rollout worker** holds an engine over its own copy of the policy. The driver's engine
  (``WorkerPool``) splits a step's requests evenly over the workers and joins their completions
  in order; seeds belong to requests, so the samples are those one process would draw.
- The **learner** actor owns the policy, the optimiser and the reference, and runs on the
  driver's node so that checkpoints land in the run directory.
- **Weights** travel through a ``WeightSync``: here Ray's object store, one object per step that
  every worker loads (after the first sync, only the trainable tensors: LoRA sends adapters).
- Rewards, data order and the run directory stay in the driver, as on the local backend.
- A recipe's ``image_overlay`` reaches every process: the driver is started in its
  environment (``launch.training``), and each actor runs with ``py_executable`` set to the
  overlay's Python on the actor's node, built there (once per node, cached) by a task placed
  where the actor will be.

A worker that dies is restarted by Ray; the pool loads the current weights into it and redoes
its share of the requests, which draws the same samples. The actors belong to the driver: when
it ends, or is killed, Ray ends them too.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import torch

from palaestra.backends.building import (
    device_of,
    engine_kind,
    make_engine,
    make_learner,
    make_sampler,
    prepare_data,
    tokenizer_of,
    without_reward,
)
from palaestra.engine.attest import (
    Attestation,
    Held,
    compare,
    sent_digests,
    shapes_of,
)
from palaestra.launch.checks import check_address, gpu_layout, import_ray, runtime_env_of
from palaestra.models.loading import load_causal_lm, load_tokenizer
from palaestra.overlay.image import overlay_steps
from palaestra.recipes import RecipeNotRunnableError
from palaestra.train.lora import apply_lora
from palaestra.train.state import Start
from palaestra.types import Completion

WORKER_RESTARTS = 3
"""How often Ray restarts a rollout worker that died, over the whole run."""
PLACEMENT_TIMEOUT_S = 60.0


def build_ray(config, start: Start):
    """The sampler and learner of ``config`` on Ray: ``num_rollout_workers`` rollout workers and
    one learner actor, on a Ray instance of the run's own or the cluster at ``ray_address``."""
    recipe = config.recipe
    tokenizer = tokenizer_of(config, start)
    data = prepare_data(config, tokenizer)  # a bad dataset fails before Ray starts
    cluster = RayCluster.connect(recipe)
    try:
        remote_config = without_reward(config)
        group = None
        if recipe.learner_ranks > 1:  # the learner sharded over rank actors
            from palaestra.backends.ray_sharded import colocated_group, start_ranks

            group = colocated_group(cluster, recipe)  # None: the split layout
            learner = start_ranks(cluster, remote_config, start, group)
        else:
            learner = RayLearner(cluster.start_learner(remote_config, start), ObjectStoreSync())
        workers = cluster.start_workers(remote_config, group)
        threads = cluster.share_cores(learner.actor, workers, recipe.max_staleness > 0)
        pool = WorkerPool(workers, threads, learner, cluster)
        if group is not None:  # the engines sleep through each update
            learner.colocate_with(pool)
        # The first sync sends every tensor (a worker starts from the model's own weights,
        # not the run's checkpoint, which may live on another machine).
        pool.update_weights(learner.weights(everything=True), start.state.step)
    except BaseException:
        cluster.shutdown()
        raise
    return make_sampler(config, pool, data), learner


def core_shares(where: list[tuple[str, int, int]], overlapped: bool) -> list[int]:
    """Torch threads for the learner and each worker, from ``where``: (node, pid, the node's
    cores) of the learner, then of each worker. A node's cores are shared among the workers
    placed on it. The learner takes all of its node's while the run alternates (it never
    trains while they sample); when the workers sample ahead of it (``overlapped``), it counts
    as one more on its node, since threads beyond the cores make every pass there wait."""
    per_node: dict[str, int] = {}
    for node, _, _ in where[1:]:
        per_node[node] = per_node.get(node, 0) + 1
    if overlapped:
        per_node[where[0][0]] = per_node.get(where[0][0], 0) + 1
    threads = [max(1, cores // per_node.get(node, 1)) for node, _, cores in where]
    if not overlapped:
        threads[0] = where[0][2]
    return threads


class RayCluster:
    """The run's connection to Ray and the actors it started; ``shutdown`` ends them all, and
    Ray itself when the run started it."""

    def __init__(self, ray, recipe, started_here: bool) -> None:
        self.ray = ray
        self.recipe = recipe
        self.started_here = started_here
        self.actors: list = []
        self.groups: list = []
        """Placement groups: they outlive their actors unless removed."""
        self.driver_node = ray.get_runtime_context().get_node_id()
        self.overlay_steps = overlay_steps(recipe.image_overlay)

    @classmethod
    def connect(cls, recipe) -> RayCluster:
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # actors' lines in train.log, uncoloured
        if recipe.ray_address is None:
            # A Ray instance of the run's own listens on loopback only (read as Ray loads).
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray = import_ray()
        runtime_env = runtime_env_of(recipe)
        if ray.is_initialized():  # a caller that set Ray up itself
            return cls(ray, recipe, started_here=False)
        started = time.monotonic()
        # ray.init installs a SIGTERM handler that exits at once; the run keeps its own, which
        # stops it cleanly (status "stopped", actors ended).
        on_sigterm = signal.getsignal(signal.SIGTERM)
        try:
            where = cls._init(ray, recipe, runtime_env)
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, on_sigterm)
        print(f"ray: connected to {where} in {time.monotonic() - started:.1f}s", flush=True)
        return cls(ray, recipe, started_here=recipe.ray_address is None)

    @staticmethod
    def _init(ray, recipe, runtime_env: dict) -> str:
        """Start or join Ray; where the run now is, in words."""
        if recipe.ray_address is None:
            from palaestra.devices import rehearsing

            need = gpu_layout(recipe).workers * recipe.ray_cpus_per_worker
            ray.init(
                address="local",  # its own instance, even beside another on this machine
                num_cpus=max(os.cpu_count() or 1, int(need + 0.999)),
                # A rehearsal declares the recipe's GPUs: Ray places them, torch uses the CPU.
                num_gpus=recipe.rollout_num_gpus if rehearsing() else None,
                include_dashboard=False,
                runtime_env=runtime_env or None,
            )
            return "a Ray instance of its own"
        if recipe.ray_address != "auto":
            check_address(recipe.ray_address)
        try:
            ray.init(address=recipe.ray_address, runtime_env=runtime_env or None)
        except (ConnectionError, ray.exceptions.AuthenticationError) as error:
            raise RecipeNotRunnableError(
                f"ray_address={recipe.ray_address!r}: {error}. A cluster that checks tokens "
                "(Ray's default) needs RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN or "
                "~/.ray/auth_token) in the environment of the process that launches runs"
            ) from None
        return f"the Ray cluster at {recipe.ray_address}"

    def start_learner(self, config, start: Start):
        """The learner actor, on the driver's node (checkpoints go to the run directory). It
        reserves no CPU: the loop never trains while the workers sample."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        where = NodeAffinitySchedulingStrategy(self.driver_node, soft=False)
        actor_class = self.ray.remote(LearnerActor).options(
            num_cpus=0,
            num_gpus=gpu_layout(config.recipe).learner,
            scheduling_strategy=where,
            max_restarts=0,
            **self.overlay_options([where])[0],
        )
        actor = actor_class.remote(config, start)
        self.actors.append(actor)
        return actor

    def start_workers(self, config, group=None) -> list:
        """``num_rollout_workers`` rollout workers, spread over the nodes, once Ray has room
        for all of them (a RecipeNotRunnableError saying what is missing, if it never does).
        With a colocated ``group`` (``ray_sharded.colocated_group``), worker i goes in its
        bundle i, beside learner rank i."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        recipe = config.recipe
        layout = gpu_layout(recipe)
        count = layout.workers
        bundle = {"CPU": recipe.ray_cpus_per_worker}
        if layout.per_worker:
            bundle["GPU"] = layout.per_worker
        if group is None:
            group = self.place([bundle] * count, "SPREAD", f"{count} rollout worker(s)")
        workers = []
        places = [PlacementGroupSchedulingStrategy(group, index) for index in range(count)]
        overlays = self.overlay_options(places)
        for index in range(count):
            actor_class = self.ray.remote(RolloutWorker).options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=places[index],
                max_restarts=WORKER_RESTARTS,
                **overlays[index],
            )
            workers.append(actor_class.remote(config, index))
        self.actors += workers
        return workers

    def place(self, bundles: list[dict], strategy: str, what: str):
        """A placement group of ``bundles``, once Ray has room for it (a RecipeNotRunnableError
        saying what is missing, if it never does)."""
        from ray.util.placement_group import placement_group

        group = placement_group(bundles, strategy=strategy)
        self.groups.append(group)
        try:
            self.ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            raise RecipeNotRunnableError(
                f"Ray could not place {what} of {bundles[0]} each within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {self.ray.available_resources()} "
                "free. Lower num_rollout_workers or ray_cpus_per_worker, or add nodes"
            ) from None
        return group

    def overlay_options(self, places: list) -> list[dict]:
        """Per place (a scheduling strategy): the ``runtime_env`` that runs an actor there in
        the overlay environment, built on that node first (empty options without one)."""
        if self.overlay_steps is None:
            return [{} for _ in places]
        build = self.ray.remote(overlay_on_this_node)
        answers = self.ray.get(
            [
                build.options(num_cpus=0, scheduling_strategy=p).remote(self.overlay_steps)
                for p in places
            ]
        )
        return [
            {"runtime_env": {"py_executable": python, "env_vars": variables}}
            for python, variables in answers
        ]

    def share_cores(self, learner, workers: list, overlapped: bool) -> list[int]:
        """Torch threads per actor (``core_shares``), set on each; returns the workers'."""
        ray = self.ray
        where = ray.get([actor.whereabouts.remote() for actor in [learner, *workers]])
        threads = core_shares(where, overlapped)
        actors = [learner, *workers]
        ray.get([a.set_threads.remote(n) for a, n in zip(actors, threads, strict=True)])
        nodes = len({node for node, _, _ in where})
        pids = [f"{pid} ({n} threads)" for (_, pid, _), n in zip(where, threads, strict=True)]
        print(
            f"ray: learner pid {pids[0]}; {len(workers)} rollout worker(s) on {nodes} node(s), "
            f"pids {', '.join(pids[1:])}",
            flush=True,
        )
        return threads[1:]

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # already gone
                pass
        for group in self.groups:
            try:
                self.ray.util.remove_placement_group(group)
            except Exception:  # already gone
                pass
        self.actors, self.groups = [], []
        if self.started_here and self.ray.is_initialized():
            self.ray.shutdown()


class WeightSync(Protocol):
    """Moves the learner's weights to every rollout worker (after each step, and to a worker
    Ray restarted). An NCCL implementation would broadcast in ``deliver`` instead."""

    def publish(self, learner, everything: bool) -> Any:
        """Make the learner's current weights available; a handle to them."""
        ...

    def deliver(self, handle: Any, workers: list, version: int) -> list:
        """Every worker in ``workers`` samples from the published weights from now on, once
        the answer it returns for that worker (an object ref, one per worker) is ready."""
        ...


class ObjectStoreSync:
    """One object per step in Ray's object store, put by the learner and read by each worker
    (zero-copy on the learner's node; Ray moves it to other nodes once per node)."""

    def publish(self, learner, everything: bool):
        import ray

        return ray.get(learner.publish.remote(everything))[0]

    def deliver(self, handle, workers: list, version: int) -> list:
        return [worker.load_weights.remote(handle, version) for worker in workers]


class RemoteWeights(Mapping):
    """Weights published through a ``WeightSync`` and not fetched: the learner handle's answer
    to ``weights()``, which the pool delivers without the driver ever holding them."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def _fetch(self) -> dict:
        import ray

        return ray.get(self.handle)

    def __getitem__(self, name: str):
        return torch.from_numpy(self._fetch()[name].copy())

    def __iter__(self) -> Iterator[str]:
        return iter(self._fetch())

    def __len__(self) -> int:
        return len(self._fetch())


class RayLearner:
    """The driver's handle on the learner actor: the learner's four methods, each a call."""

    def __init__(self, actor, sync: WeightSync) -> None:
        import ray

        self.ray = ray
        self.actor = actor
        self.sync = sync

    def train_step(self, samples_B, advantages_B) -> dict:
        return self._get(self.actor.train_step.remote(list(samples_B), list(advantages_B)))

    def weights(self, everything: bool = False) -> RemoteWeights:
        try:
            return RemoteWeights(self.sync.publish(self.actor, everything))
        except self.ray.exceptions.RayActorError as error:
            raise self._died(error) from error

    def save(self, folder) -> None:
        self._get(self.actor.save.remote(str(folder)))

    def load(self, folder) -> None:
        self._get(self.actor.load.remote(str(folder)))

    def _get(self, ref):
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayActorError as error:
            raise self._died(error) from error

    @staticmethod
    def _died(error: Exception) -> RuntimeError:
        """The learner holds the optimiser's state, so Ray does not restart it: the run fails,
        and resume() continues from the last checkpoint."""
        return RuntimeError(
            f"the learner actor died ({type(error).__name__}); continue the run from its last "
            "checkpoint with resume()"
        )


class WorkerPool:
    """The driver's engine: a step's requests split over the rollout workers, in order."""

    def __init__(self, workers: list, threads: list[int], learner, cluster: RayCluster) -> None:
        import ray

        self.ray = ray
        self.workers = workers
        self.threads = threads
        """Each worker's torch threads, for its restart."""
        self.learner = learner
        self.cluster = cluster
        self.weight_version = 0
        self.deaths = 0
        self.max_context = ray.get(workers[0].max_context.remote())
        """Most tokens one row may hold, as the workers' engines count them."""

    def update_weights(self, weights: Mapping[str, Any], version: int) -> Attestation:
        """Every worker loads ``weights`` and reports a digest of a few tensors as it holds
        them, which is checked against the same tensors as the learner sent them."""
        if isinstance(weights, RemoteWeights):
            handle = weights.handle
        else:  # a plain mapping of tensors: put it in the object store once
            handle = self.ray.put({k: v.detach().cpu().numpy() for k, v in weights.items()})
        self.weight_version = version
        loads = self.learner.sync.deliver(handle, self.workers, version)
        # A worker that died gets the weights as it restarts, attested there.
        reports = [self._await(index, ref) for index, ref in enumerate(loads)]
        return self._attest(handle, [r for r in reports if r], version)

    def _attest(self, handle, reports: list[dict], version: int) -> Attestation:
        """``WeightSyncError`` unless each worker's report holds the learner's digests; the
        learner's are computed where its object lives (zero-copy), once per dtype."""
        started = time.monotonic()
        expected: dict[tuple, Held] = {}
        engines = 0
        for report in reports:
            held = report["held"]
            kinds = tuple(sorted((name, dtype) for name, (dtype, _) in held.items()))
            if kinds not in expected:
                expected[kinds] = self.ray.get(self.learner.actor.sent_digests.remote(handle, held))
            where = f"rollout worker {report['index']} (pid {report['pid']}, node {report['node']})"
            engines += compare(expected[kinds], held, where, version) > 0
        worker_s = max((r["seconds"] for r in reports), default=0.0)
        return Attestation(engines, worker_s + time.monotonic() - started)

    def generate_requests(self, requests: list) -> list[list[Completion]]:
        # Callbacks and cancel events belong to a server in this process; rollouts set none.
        requests = [replace(r, on_token=None, cancel=None) for r in requests]
        shares = split_evenly(len(requests), len(self.workers))
        refs = [
            worker.generate.remote(requests[lo:hi])
            for worker, (lo, hi) in zip(self.workers, shares, strict=True)
        ]
        completions: list[list[Completion]] = []
        for index, ((lo, hi), ref) in enumerate(zip(shares, refs, strict=True)):
            redo = partial(self.workers[index].generate.remote, requests[lo:hi])
            version, share = self._await(index, ref, redo)
            if version != self.weight_version:
                raise RuntimeError(
                    f"rollout worker {index} sampled from weights version {version}, but the "
                    f"learner's are version {self.weight_version}"
                )
            completions += share
        return completions

    def _await(self, index: int, ref, redo=None):
        """Worker ``index``'s answer. If it died: once Ray restarted it, the learner's weights
        are loaded into it and ``redo()`` (its requests again: same seeds, same samples) gives
        a new answer to wait for."""
        ray = self.ray
        while True:
            try:
                return ray.get(ref)
            except ray.exceptions.RayActorError as error:
                self.deaths += 1
                if self.deaths > WORKER_RESTARTS:
                    raise RuntimeError(
                        f"rollout worker {index} died ({type(error).__name__}); workers have "
                        f"died {self.deaths} times in this run, more than Ray restarts them. "
                        "Continue the run from its last checkpoint with resume()"
                    ) from error
                print(
                    f"ray: rollout worker {index} died ({type(error).__name__}); loading "
                    f"weights version {self.weight_version} into its restart"
                    + (" and redoing its requests" if redo else ""),
                    flush=True,
                )
                self._reload(index)
                if redo is None:
                    return None
                ref = redo()

    def _reload(self, index: int) -> None:
        """Wait for worker ``index`` to come back, then give it every tensor of the learner's
        current weights (a restart starts from the model's own)."""
        ray, worker = self.ray, self.workers[index]
        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        while True:
            try:
                ray.get(worker.set_threads.remote(self.threads[index]))
                break
            except ray.exceptions.RayActorError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        handle = self.learner.weights(everything=True).handle
        reports = ray.get(self.learner.sync.deliver(handle, [worker], self.weight_version))
        self._attest(handle, reports, self.weight_version)  # a restart is attested too

    def close(self) -> None:
        self.cluster.shutdown()


def overlay_on_this_node(steps: list) -> tuple[str, dict[str, str]]:
    """A Ray task: the overlay environment of ``steps`` on the node it runs on, built there
    unless cached; its Python and the variables a process in it gets."""
    from palaestra.overlay.environment import ensure_overlay

    overlay = ensure_overlay(steps)
    if overlay.built_s is not None:
        print(f"ray: node {os.uname().nodename}: {overlay.describe()}", flush=True)
    return str(overlay.python), overlay.environment()


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(lo, hi)`` ranges covering ``range(count)``, sizes differing by
    at most one, larger ones first."""
    size, extra = divmod(count, parts)
    bounds, lo = [], 0
    for part in range(parts):
        hi = lo + size + (1 if part < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def parameters_digest(module: torch.nn.Module, dtype: torch.dtype) -> str:
    """A hash of ``module``'s parameters by name, cast to ``dtype``: two modules with equal
    digests hold the same weights bit for bit."""
    digest = hashlib.blake2b(digest_size=16)
    for name, parameter in sorted(module.named_parameters()):
        digest.update(name.encode())
        digest.update(parameter.detach().to(dtype).contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


class ActorBase:
    """What both actors answer: where they run, and how many threads to use."""

    def __init__(self) -> None:
        from transformers.utils import logging

        sys.stdout.reconfigure(line_buffering=True)
        logging.disable_progress_bar()  # per-tensor loading bars would bury train.log

    def whereabouts(self) -> tuple[str, int, int]:
        import ray

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return ray.get_runtime_context().get_node_id(), os.getpid(), int(cores or 1)

    def set_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)

    def sent_digests(self, arrays: dict, held: Held) -> Held:
        """Digests of the published ``arrays`` (Ray hands over the object in this process,
        zero-copy on its node) for the tensors a worker reported ``held``, in its dtypes."""
        with warnings.catch_warnings():  # read-only arrays, only read
            warnings.simplefilter("ignore", UserWarning)
            return sent_digests({name: torch.from_numpy(arrays[name]) for name in held}, held)


class LearnerActor(ActorBase):
    """The learner in its own process: built as the local backend builds it."""

    def __init__(self, config, start: Start) -> None:
        super().__init__()
        tokenizer = tokenizer_of(config, start)
        self.learner = make_learner(config, start, tokenizer, device_of(config))

    def train_step(self, samples_B, advantages_B) -> dict:
        return self.learner.train_step(samples_B, advantages_B)

    def publish(self, everything: bool) -> list:
        """The weights as numpy arrays in the object store (every tensor, or the trainable
        ones); wrapped in a list so that the caller gets the reference, not the arrays."""
        import ray

        arrays = {
            name: parameter.detach().cpu().numpy()
            for name, parameter in self.learner.model.named_parameters()
            if everything or parameter.requires_grad
        }
        return [ray.put(arrays)]

    def save(self, folder: str) -> None:
        self.learner.save(folder)

    def load(self, folder: str) -> None:
        self.learner.load(folder)

    def digest(self, dtype: torch.dtype) -> str:
        return parameters_digest(self.learner.model, dtype)


class RolloutWorker(ActorBase):
    """An engine over its own copy of the policy (the model's weights, with the run's LoRA
    adapters if any); the first sync loads the learner's weights into it."""

    def __init__(self, config, index: int) -> None:
        super().__init__()
        self.index = index
        recipe, model_config = config.recipe, config.model
        tokenizer = load_tokenizer(
            model_config.weights_path(), model_config.chat_template, model_config.revision
        )
        model = None
        if engine_kind(recipe, device_of(config)) == "torch":  # vLLM loads its own copy
            model = load_causal_lm(
                model_config.weights_path(),
                torch.float32,
                device_of(config),
                model_config.revision,
                model_config.trust_remote_code,
            )
            if recipe.lora_rank:
                model = apply_lora(model, recipe)
            model.config.use_cache = True
        self.engine = make_engine(config, model, tokenizer, model_config.weights_path())

    def generate(self, requests: list) -> tuple[int, list[list[Completion]]]:
        """Completions of ``requests``, with the weight version that sampled them."""
        return self.engine.weight_version, self.engine.generate_requests(requests)

    def load_weights(self, arrays: dict, version: int) -> dict:
        """Load ``arrays``; a report of what the engine then holds, for the sync's attestation
        (``engine.attest``): digests of a few of them, picked by ``version``, and who it is."""
        import ray

        with warnings.catch_warnings():  # object-store arrays are read-only; they are copied
            warnings.simplefilter("ignore", UserWarning)
            tensors = {name: torch.from_numpy(array) for name, array in arrays.items()}
        self.engine.update_weights(tensors, version)
        started = time.monotonic()
        held = self.engine.weight_digests(shapes_of(tensors), version)
        return {
            "index": self.index,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id()[:12],
            "held": held,
            "seconds": time.monotonic() - started,
        }

    def digest(self, dtype: torch.dtype) -> str:
        return parameters_digest(self.engine.model, dtype)

    def sleep(self) -> int:
        """Free what the engine can rebuild while a learner rank trains on its GPU; bytes."""
        return self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def max_context(self) -> int:
        return self.engine.max_context
