"""The Ray backend's sharded learner: the learner's ranks as Ray actors, one
``torch.distributed`` group over them (``train.sharded``), in place of the one learner actor.

The ranks run on the driver's node, as the one learner actor does: the checkpoint's ranks all
write into the run directory (the consolidated weights from rank 0, optimiser shards from
each), so they need its file system. Weights reach the rollout workers as the one learner's
do: rank 0 puts every gathered tensor (float32 numpy arrays, which the object store holds
without a copy) in one object that each worker loads, and the pool's checks apply unchanged.
"""

from __future__ import annotations

from typing import Any

from palaestra.backends.ray import ActorBase, ObjectStoreSync, RemoteWeights
from palaestra.backends.sharded import ShardedBuild
from palaestra.train.sharded_driver import BUCKET_BYTES, free_port, join_group
from palaestra.train.state import Start


class LearnerRankActor(ActorBase):
    """One rank of the learner; ``join`` (called on every rank at once) builds it."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        self.learner = None

    def join(self, port: int, config, start: Start) -> None:
        self.learner = join_group(
            self.rank, self.world, port, ShardedBuild(config, start), config.recipe
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

    def publish(self, learner, everything: bool):
        import ray

        return ray.get([rank.publish.remote(everything) for rank in learner])[0][0]


class RayShardedLearner:
    """The driver's handle on the rank actors: each of the learner's methods is a call on
    every rank, rank 0 answering. A rank that dies fails the run naming it."""

    def __init__(self, ranks: list, sync: ShardedSync) -> None:
        import ray

        self.ray = ray
        self.ranks = ranks
        self.actor = ranks[0]  # where the cluster asks the learner's whereabouts
        self.sync = sync

    def train_step(self, samples_B, advantages_B) -> dict:
        samples_B, advantages_B = list(samples_B), list(advantages_B)
        return self._all("train_step", samples_B, advantages_B)

    def weights(self, everything: bool = False) -> RemoteWeights:
        try:
            return RemoteWeights(self.sync.publish(self.ranks, everything))
        except self.ray.exceptions.RayActorError as error:
            raise self._died(error) from error

    def save(self, folder) -> None:
        self._all("save", str(folder))

    def load(self, folder) -> None:
        self._all("load", str(folder))

    def _all(self, method: str, *args):
        refs = [getattr(rank, method).remote(*args) for rank in self.ranks]
        answers = []
        for index, ref in enumerate(refs):
            try:
                answers.append(self.ray.get(ref))
            except self.ray.exceptions.RayActorError as error:
                raise self._died(error, index) from error
        return answers[0]

    def _died(self, error: Exception, index: int | None = None) -> RuntimeError:
        which = "a learner rank" if index is None else f"learner rank {index}"
        return RuntimeError(
            f"{which} died ({type(error).__name__}); the learner's ranks share its state, so "
            "the run fails: continue it from its last checkpoint with resume()"
        )


def start_ranks(cluster, config, start: Start) -> RayShardedLearner:
    """``recipe.learner_ranks`` rank actors on the driver's node, joined into one group, the
    starting checkpoint's optimiser state loaded when it fits (as ``make_learner`` does)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from palaestra.checkpoints import has_optimizer_state, is_adapter_checkpoint

    recipe = config.recipe
    world = recipe.learner_ranks
    actor_class = cluster.ray.remote(LearnerRankActor).options(
        num_cpus=0,  # the loop never trains while the workers sample
        scheduling_strategy=NodeAffinitySchedulingStrategy(cluster.driver_node, soft=False),
        max_restarts=0,
    )
    ranks = [actor_class.remote(rank, world) for rank in range(world)]
    cluster.actors += ranks
    port = free_port()  # on the driver's node, where rank 0 listens
    learner = RayShardedLearner(ranks, ShardedSync())
    learner._all("join", port, config, start)
    checkpoint = start.checkpoint
    fits = not recipe.lora_rank or checkpoint is None or is_adapter_checkpoint(checkpoint)
    if checkpoint is not None and fits and has_optimizer_state(checkpoint):
        learner.load(checkpoint)
    return learner
