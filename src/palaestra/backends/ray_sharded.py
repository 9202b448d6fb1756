"""The Ray backend's sharded learner: the learner's ranks as Ray actors, one
``torch.distributed`` group over them (``train.sharded``), in place of the one learner actor.

The ranks run on the driver's node, as the one learner actor does: the checkpoint's ranks all
write into the run directory (the consolidated weights from rank 0, optimiser shards from
each), so they need its file system. Weights reach the rollout workers as the one learner's
do: rank 0 puts every gathered tensor (float32 numpy arrays, which the object store holds
without a copy) in one object that each worker loads, and the pool's checks apply unchanged.

**Colocated** (``colocate=True``, ``rollout_num_gpus`` = the ranks): one placement group of N
bundles of one GPU each, packed on the driver's node; learner rank i and rollout worker i share
bundle i, half a GPU each in Ray's accounting. Each update runs with the engines asleep
(``RolloutEngine.sleep``), and they wake before the weight sync; ``sleep_s``, ``wake_s`` and
``sleep_freed_bytes`` land in the step's metrics. A rank's device is the GPU Ray gave its actor
(``cuda:0`` within its ``CUDA_VISIBLE_DEVICES``), over NCCL; with ``PALAESTRA_DEVICE=cpu``
(``devices.rehearsing``) the CPU over gloo. NCCL ranks and the colocated layout have only run
in that rehearsal, never on a real GPU.
"""

from __future__ import annotations

import os
import time
from typing import Any

from palaestra.backends.ray import ActorBase, ObjectStoreSync, RemoteWeights
from palaestra.backends.sharded import ShardedBuild
from palaestra.devices import torch_device_type
from palaestra.launch.checks import COLOCATED_SHARE, colocated
from palaestra.recipes import RecipeNotRunnableError
from palaestra.train.sharded_driver import BUCKET_BYTES, DEATH_GRACE_S, free_port, join_group
from palaestra.train.state import Start


class LearnerRankActor(ActorBase):
    """One rank of the learner; ``join`` (called on every rank at once) builds it."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        self.learner = None

    def join(self, port: int, config, start: Start) -> None:
        # Ray's CUDA_VISIBLE_DEVICES holds only this actor's GPU (ray.get_gpu_ids()), so it
        # is cuda:0 here, whatever the rank. Not yet run on a real GPU.
        cuda = torch_device_type(config.recipe.rollout_num_gpus) == "cuda"
        self.learner = join_group(
            self.rank,
            self.world,
            port,
            ShardedBuild(config, start),
            config.recipe,
            "cuda:0" if cuda else "cpu",
        )

    def train_step(self, samples_B, advantages_B) -> dict:
        metrics = self.learner.train_step(samples_B, advantages_B)
        return {key: float(value) for key, value in metrics.items()}

    def publish(self, everything: bool) -> list:
        """Every rank gathers; rank 0 puts the weights in the object store and returns the
        reference, wrapped in a list so that the caller gets the reference itself."""
        import ray
        import torch

        arrays: dict[str, Any] = {}

        def keep(bucket: dict) -> None:
            arrays.update({name: tensor.numpy() for name, tensor in bucket.items()})

        self.learner.gather_weights(everything, torch.float32, BUCKET_BYTES, keep)
        return [ray.put(arrays) if self.rank == 0 else None]

    def save(self, folder: str) -> None:
        self.learner.save(folder)

    def load(self, folder: str) -> None:
        self.learner.load(folder)


class ShardedSync(ObjectStoreSync):
    """``ObjectStoreSync`` over a group of ranks: all gather, rank 0's object is delivered."""

    def publish(self, learner: RayShardedLearner, everything: bool):
        return learner._all("publish", everything)[0]


class RayShardedLearner:
    """The driver's handle on the rank actors: each of the learner's methods is a call on
    every rank, rank 0 answering. A rank that dies fails the run naming it."""

    def __init__(self, ranks: list, sync: ShardedSync) -> None:
        import ray

        self.ray = ray
        self.ranks = ranks
        self.actor = ranks[0]  # where the cluster asks the learner's whereabouts
        self.sync = sync
        self.pool = None
        """The rollout workers on the ranks' GPUs (colocated): asleep through each update."""

    def colocate_with(self, pool) -> None:
        """Share the ranks' GPUs with the rollout workers of ``pool`` (worker i beside rank i):
        check that Ray put each pair on one GPU, say where, and sleep them through each update
        from now on."""
        ray = self.ray
        pairs = list(zip(self.ranks, pool.workers, strict=True))
        places = ray.get([a.__ray_call__.remote(placement) for pair in pairs for a in pair])
        lines = []
        for index in range(len(pairs)):
            (group, gpus, rank_pid, _), worker = places[2 * index], places[2 * index + 1]
            if (group, gpus) != worker[:2]:
                raise RuntimeError(
                    f"colocate: Ray placed learner rank {index} on GPU(s) {gpus} of placement "
                    f"group {group}, and rollout worker {index} on {worker[1]} of {worker[0]}; "
                    "they should share one"
                )
            lines.append(f"bundle {index}: GPU {gpus}, rank pid {rank_pid}, worker pid {worker[2]}")
        devices = sorted({place[3] for place in places})
        print(
            f"ray: colocated on placement group {places[0][0]}, learner rank i and rollout "
            f"worker i in bundle i: {'; '.join(lines)}; device {', '.join(devices)}",
            flush=True,
        )
        self.pool = pool

    def train_step(self, samples_B, advantages_B) -> dict:
        samples_B, advantages_B = list(samples_B), list(advantages_B)
        if self.pool is None:
            return self._all("train_step", samples_B, advantages_B)
        started = time.monotonic()
        freed = self._engines("sleep")
        slept = time.monotonic()
        metrics = self._all("train_step", samples_B, advantages_B)
        trained = time.monotonic()
        self._engines("wake")  # before the weight sync, which loads into awake engines
        return metrics | {
            "sleep_s": slept - started,
            "wake_s": time.monotonic() - trained,
            "sleep_freed_bytes": sum(n or 0 for n in freed),
        }

    def _engines(self, method: str) -> list:
        """``method`` on every colocated engine. One that died is restarted by Ray and loaded
        with the current weights by the pool (as when it dies sampling), then put back to
        sleep: the update goes on."""
        workers = self.pool.workers
        refs = [getattr(worker, method).remote() for worker in workers]
        answers = []
        for index, ref in enumerate(refs):
            answer = self.pool._await(index, ref)  # None: it died and was restarted
            if answer is None and method == "sleep":
                answer = self.ray.get(workers[index].sleep.remote())
            answers.append(answer)
        return answers

    def weights(self, everything: bool = False) -> RemoteWeights:
        return RemoteWeights(self.sync.publish(self, everything))

    def save(self, folder) -> None:
        self._all("save", str(folder))

    def load(self, folder) -> None:
        self._all("load", str(folder))

    def _all(self, method: str, *args):
        """Rank 0's answer once every rank answered. Answers are taken as they come: a rank
        that died fails the call at once, naming it, while the others wait for it in a
        collective (until ``COLLECTIVE_TIMEOUT``, if nothing stopped them)."""
        refs = [getattr(rank, method).remote(*args) for rank in self.ranks]
        index_of = {ref: index for index, ref in enumerate(refs)}
        pending, answers = refs, {}
        while pending:
            (ref,), pending = self.ray.wait(pending, num_returns=1)
            try:
                answers[index_of[ref]] = self.ray.get(ref)
            except self.ray.exceptions.RayActorError as error:
                raise self._died(error, index_of[ref]) from error
            except self.ray.exceptions.RayTaskError:
                # A rank whose peer died fails in the collective ("connection reset") often
                # before Ray reports the death: name the rank that died if one did.
                self._name_the_dead(pending, index_of)
                raise
        return answers[0]

    def _name_the_dead(self, pending: list, index_of: dict) -> None:
        """Raise ``_died`` for the first of ``pending`` whose actor Ray reports dead within
        ``DEATH_GRACE_S``; return if none is."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while pending and (left := deadline - time.monotonic()) > 0:
            done, pending = self.ray.wait(pending, num_returns=1, timeout=left)
            for ref in done:
                try:
                    self.ray.get(ref)
                except self.ray.exceptions.RayActorError as error:
                    raise self._died(error, index_of[ref]) from error
                except self.ray.exceptions.RayTaskError:
                    pass

    def _died(self, error: Exception, index: int) -> RuntimeError:
        return RuntimeError(
            f"learner rank {index} died ({type(error).__name__}); the learner's ranks share its "
            "state, so the run fails: continue it from its last checkpoint with resume()"
        )


def placement(actor) -> tuple[str | None, list, int, str]:
    """Where ``actor`` runs (called in it): its placement group, the GPU ids Ray assigned it,
    its pid, and the device torch uses there (the rehearsal switch as the actor sees it)."""
    import ray

    from palaestra.devices import DEVICE_VAR, rehearsing

    device = f"cpu ({DEVICE_VAR}=cpu)" if rehearsing() else "cuda"
    context = ray.get_runtime_context()
    return context.get_placement_group_id(), ray.get_gpu_ids(), os.getpid(), device


def colocated_group(cluster, recipe):
    """For a colocated recipe, the placement group its ranks and engines share: N bundles of
    {GPU: 1, CPU: ray_cpus_per_worker}, packed on the driver's node (rank 0 listens on its
    loopback, and the checkpoint's ranks write into the run directory). None otherwise."""
    if not colocated(recipe):
        return None
    n = recipe.rollout_num_gpus
    bundle = {"GPU": 1, "CPU": recipe.ray_cpus_per_worker}
    group = cluster.place([bundle] * n, "STRICT_PACK", f"{n} colocated learner rank(s) + engine")
    from ray.util.placement_group import placement_group_table

    nodes = set(placement_group_table(group)["bundles_to_node_id"].values())
    if nodes != {cluster.driver_node}:
        raise RecipeNotRunnableError(
            f"colocate=True: Ray placed the {n} GPUs on node {nodes.pop()}, not on the node "
            "that runs the driver; launch the run from the node with the GPUs (the learner's "
            "ranks meet on its loopback and write checkpoints to its run directory)"
        )
    return group


def start_ranks(cluster, config, start: Start, group=None) -> RayShardedLearner:
    """``recipe.learner_ranks`` rank actors on the driver's node (rank i in bundle i of a
    colocated ``group``), joined into one group, the starting checkpoint's optimiser state
    loaded when it fits (as ``make_learner`` does)."""
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    from palaestra.checkpoints import has_optimizer_state, is_adapter_checkpoint

    recipe = config.recipe
    world = recipe.learner_ranks
    actor_class = cluster.ray.remote(LearnerRankActor)
    # No CPU reserved: the loop never trains while the workers sample.
    common = {"num_cpus": 0, "max_restarts": 0}
    if group is None:
        where = NodeAffinitySchedulingStrategy(cluster.driver_node, soft=False)
        places = [{"scheduling_strategy": where}] * world
    else:
        places = [
            {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, rank)}
            | {"num_gpus": COLOCATED_SHARE}
            for rank in range(world)
        ]
    ranks = [
        actor_class.options(**common, **places[rank]).remote(rank, world) for rank in range(world)
    ]
    cluster.actors += ranks
    port = free_port()  # on the driver's node, where rank 0 listens
    learner = RayShardedLearner(ranks, ShardedSync())
    learner._all("join", port, config, start)
    checkpoint = start.checkpoint
    fits = not recipe.lora_rank or checkpoint is None or is_adapter_checkpoint(checkpoint)
    if checkpoint is not None and fits and has_optimizer_state(checkpoint):
        learner.load(checkpoint)
    return learner
