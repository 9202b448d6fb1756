"""The sharded learner's handle: N rank processes (``train.sharded.RankLearner``) in one
``torch.distributed`` group, driven through the learner's interface (``train_step``,
``weights``, ``save``, ``load``).

The run's process starts the ranks (spawned, so nothing of its own state is forked into them)
and sends every rank the same command over a pipe; rank 0 answers for all. Weights come back
gathered tensor by tensor, in buckets of the engine's dtype, through shared memory (a tensor
sent over a multiprocessing pipe travels as a handle on its storage, not as pickled bytes).
A rank that fails or dies fails the call, naming the rank; the other ranks are stopped, since
they would wait in their next collective until it timed out.
"""

from __future__ import annotations

import atexit
import os
import socket
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

from palaestra.recipes import Recipe

BUCKET_BYTES = 64 << 20
"""About how much of the weights one message carries from rank 0."""
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
"""How long a rank waits in a collective for the others (a dead peer fails it after this)."""
DEATH_GRACE_S = 10.0
"""How long, after one rank failed, the driver waits for another to be reported dead, so the
error names the rank that died rather than its peer's broken collective."""


class LearnerRankError(RuntimeError):
    """A rank of the sharded learner failed or died; the run fails and ``resume()`` continues
    it from its last checkpoint."""


class ShardedLearner:
    """The learner as ``recipe.learner_ranks`` processes; ``build`` (picklable, run in each
    rank) returns a ``train.sharded.RankParts``. ``sync_dtype`` is the engine's dtype, the
    weights' dtype on the way to it."""

    def __init__(
        self, build: Callable[[], Any], recipe: Recipe, sync_dtype: torch.dtype = torch.float32
    ) -> None:
        import torch.multiprocessing as mp

        self.sync_dtype = sync_dtype
        self.last_sync_bytes = 0
        self._synced_once = False
        context = mp.get_context("spawn")
        port = free_port()
        self.conns, self.processes = [], []
        for rank in range(recipe.learner_ranks):
            parent, child = context.Pipe()
            process = context.Process(
                target=rank_main,
                args=(rank, recipe.learner_ranks, port, build, recipe, child),
                name=f"palaestra-learner-rank-{rank}",
                daemon=True,  # never outlives the run's process
            )
            process.start()
            child.close()
            self.conns.append(parent)
            self.processes.append(process)
        atexit.register(self.close)
        self._collect()  # each rank built and sharded its part

    # -- The learner's interface.
    def train_step(self, samples_B, advantages_B) -> dict:
        return self._call("train_step", list(samples_B), list(advantages_B))

    def weights(self, everything: bool | None = None) -> dict[str, torch.Tensor]:
        """Every parameter whole, in the engine's dtype: all of them the first time (the
        engine's copy may hold other weights), then the trainable ones."""
        everything = not self._synced_once if everything is None else everything
        received: dict[str, torch.Tensor] = {}
        self._send("gather_weights", everything, self.sync_dtype, BUCKET_BYTES)
        self._collect(on_bucket=received.update)
        self._synced_once = True
        self.last_sync_bytes = sum(t.numel() * t.element_size() for t in received.values())
        return received

    def save(self, folder: Path) -> None:
        self._call("save", Path(folder))

    def load(self, folder: Path) -> None:
        self._call("load", Path(folder))

    def close(self) -> None:
        """Stop the ranks (they leave their process group first); safe to call twice."""
        for conn in self.conns:
            try:
                conn.send(("close", ()))
            except (BrokenPipeError, OSError):
                pass
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns, self.processes = [], []

    # -- Commands.
    def _call(self, method: str, *args) -> Any:
        self._send(method, *args)
        return self._collect()

    def _send(self, method: str, *args) -> None:
        if not self.conns:
            raise LearnerRankError("the sharded learner is closed")
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                self._fail(rank, f"died (exit code {process.exitcode})")
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((method, args))
            except (BrokenPipeError, OSError) as error:
                self._fail(rank, f"cannot be reached ({error})")

    def _collect(self, on_bucket: Callable[[Mapping], None] | None = None) -> Any:
        """Rank 0's answer once every rank has answered; a rank's error or death fails it."""
        pending = dict(enumerate(self.conns))
        answer = None
        while pending:
            by_handle = {conn: rank for rank, conn in pending.items()}
            sentinels = {self.processes[rank].sentinel: rank for rank in pending}
            for ready in wait([*by_handle, *sentinels]):
                if ready in sentinels:
                    rank = sentinels[ready]
                    if not pending[rank].poll():
                        code = self.processes[rank].exitcode
                        self._fail(rank, f"died (exit code {code})")
                    continue
                rank = by_handle[ready]
                try:
                    kind, value = ready.recv()
                except EOFError:
                    continue  # its sentinel says why
                if kind == "bucket" and on_bucket is not None:
                    on_bucket(value)
                elif kind == "error":
                    self._name_the_dead([r for r in pending if r != rank])
                    self._fail(rank, f"failed:\n{value}")
                elif kind == "ok":
                    del pending[rank]
                    answer = value if rank == 0 else answer
        return answer

    def _name_the_dead(self, ranks: list[int]) -> None:
        """Fail naming the first of ``ranks`` whose process ends within ``DEATH_GRACE_S``:
        a rank whose peer died fails in the collective ("connection reset"), often before the
        dead one's sentinel is seen. Return if none ends."""
        sentinels = {self.processes[rank].sentinel: rank for rank in ranks}
        for ready in wait(list(sentinels), timeout=DEATH_GRACE_S):
            rank = sentinels[ready]
            self._fail(rank, f"died (exit code {self.processes[rank].exitcode})")

    def _fail(self, rank: int, what: str):
        pid = self.processes[rank].pid
        self.close()
        raise LearnerRankError(
            f"learner rank {rank} (pid {pid}) {what}\nThe other ranks were stopped; continue "
            "the run from its last checkpoint with resume()"
        )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def join_group(rank: int, world: int, port: int, build, recipe: Recipe, device=None):
    """This process as rank ``rank`` of the learner's group (rank 0 listening on ``port`` of
    this machine): its device, the group, and its ``RankLearner`` built by ``build``.
    ``device``: the caller's choice (a Ray actor's GPU); by default ``cuda:{rank}`` for a GPU
    recipe on a machine with CUDA, else the CPU (and always the CPU in a rehearsal)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from palaestra.devices import torch_device_type
    from palaestra.train.sharded import RankLearner

    if device is None:
        cuda = torch_device_type(recipe.rollout_num_gpus) == "cuda" and torch.cuda.is_available()
        device = f"cuda:{rank}" if cuda else "cpu"
    device = torch.device(device)
    cuda = device.type == "cuda"  # NCCL ranks: never run on a real GPU yet
    if cuda:
        torch.cuda.set_device(device)
    else:  # the machine's cores, shared among the ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    mesh = init_device_mesh(device.type, (world,))
    return RankLearner(build(), recipe, mesh, device)


def rank_main(rank: int, world: int, port: int, build, recipe: Recipe, conn) -> None:
    """A rank's process: join the group, build and shard, then run commands until "close"."""
    import torch.distributed as dist

    try:
        try:
            learner = join_group(rank, world, port, build, recipe)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            return
        conn.send(("ok", None))
        serve(learner, conn)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def serve(learner, conn) -> None:
    """Run the driver's commands on ``learner`` until "close" (or the driver is gone)."""

    def send_bucket(bucket: dict) -> None:
        conn.send(("bucket", bucket))

    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        if method == "close":
            return
        try:
            if method == "gather_weights":
                result = learner.gather_weights(*args, send=send_bucket)
            else:
                result = getattr(learner, method)(*args)
            if method == "train_step":
                result = {key: float(value) for key, value in result.items()}
            conn.send(("ok", result if method != "gather_weights" else None))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            return
