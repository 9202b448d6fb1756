"""The training process: ``python -m palaestra.launch.worker RUN_DIR [--resume]``.

It loads the pickled TrainConfig from the run directory, trains, and records how it ended in
status.json: completed, failed (with the error) or stopped (SIGTERM). ``kill -USR1 PID`` makes
it write every thread's Python stack to train.log and carry on: where a run that seems stuck is.
A crash of the interpreter itself (a segfault in an extension) writes its stacks there too.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import cloudpickle

from palaestra.runs.directory import RunDirectory
from palaestra.runs.liveness import process_start_time
from palaestra.runs.trust import read_signed


class StopRequested(BaseException):
    """Raised in the training process by SIGTERM; BaseException so no handler swallows it."""


STOP_AGAIN_S = 0.01
"""How long after an ignored StopRequested the stop is signalled again."""


def _request_stop(signum, frame) -> None:
    raise StopRequested()


def _stop_again_if_ignored(unraisable) -> None:
    """``sys.unraisablehook``: a SIGTERM's StopRequested that landed where Python ignores
    exceptions (a weakref callback the garbage collector ran, a ``__del__``: "Exception
    ignored in ...", and the run went on until the stopper's SIGKILL) is signalled again from
    another thread, a moment later, to land in the code that was running (signalled from here,
    it would raise in this hook, which ignores it too); anything else is reported as Python
    would."""
    if isinstance(unraisable.exc_value, StopRequested):
        again = threading.Timer(STOP_AGAIN_S, os.kill, (os.getpid(), signal.SIGTERM))
        again.daemon = True
        again.start()
        return
    sys.__unraisablehook__(unraisable)


def _dump_stacks(signum, frame) -> None:
    """Write every thread's Python stack to stderr (train.log), newest call first, in the
    format of ``faulthandler``'s dumps.

    A Python-level handler runs in the main thread between bytecodes, so no thread's frames
    can vanish while they are read. ``faulthandler.register(SIGUSR1)`` reads them from inside
    the signal, and a thread that exits meanwhile can crash the process (CPython issue
    116008): a signal meant to look at a run must not be able to end it."""
    global _dumping
    if _dumping:  # a second signal during a dump: that dump answers it
        return
    _dumping = True
    try:
        _write_stacks(frame)
    finally:
        _dumping = False


_dumping = False


def _write_stacks(frame) -> None:
    main = threading.get_ident()
    lines = []
    for ident, top in sys._current_frames().items():
        if ident == main:
            top = frame  # the interrupted frame, not this handler's
        lines.append(
            f"{'Current thread' if ident == main else 'Thread'} 0x{ident:016x} "
            "(most recent call first):"
        )
        while top is not None:
            code = top.f_code
            lines.append(f'  File "{code.co_filename}", line {top.f_lineno} in {code.co_name}')
            top = top.f_back
        lines.append("")
    os.write(2, "\n".join(lines).encode(errors="replace"))


def execute(run: RunDirectory, config=None, resume: bool = False) -> None:
    """Train ``run`` and record the outcome; never raises for a training error."""
    from palaestra.train.loop import run_training

    run.update_status(
        state="running",
        pid=os.getpid(),
        pid_start=process_start_time(os.getpid()),
        started_at=time.time(),
        error=None,
        traceback=None,
    )
    try:
        if config is None:
            config = cloudpickle.loads(read_signed(run.path / "config.pkl"))
        run_training(config, run, backend_of(config), resume=resume)
    except (StopRequested, KeyboardInterrupt):
        print("palaestra: stopped", flush=True)
        run.update_status(state="stopped", finished_at=time.time())
    except BaseException as error:
        traceback.print_exc()
        sys.stdout.flush()
        run.update_status(
            state="failed",
            error=f"{type(error).__name__}: {error}",
            traceback=traceback.format_exc(),
            finished_at=time.time(),
        )
    else:
        run.update_status(state="completed", finished_at=time.time())


def backend_of(config):
    """The function that builds ``config``'s sampler and learner (``recipe.backend``; more
    than one GPU takes Ray's, a Ray instance of the run's own placing the learner and the
    rollout workers on them: ``launch.checks.gpu_layout``)."""
    if config.recipe.backend == "ray" or config.recipe.rollout_num_gpus > 1:
        from palaestra.backends.ray import build_ray

        return build_ray
    from palaestra.backends.local import build_local

    return build_local


def install_signal_handlers() -> None:
    """SIGTERM stops the run, SIGUSR1 dumps every thread's stack, and a fatal signal (a crash
    in native code) leaves the stacks in stderr before the process dies."""
    signal.signal(signal.SIGTERM, _request_stop)
    sys.unraisablehook = _stop_again_if_ignored
    signal.signal(signal.SIGUSR1, _dump_stacks)
    faulthandler.enable()


ENTER_OVERLAY = "PALAESTRA_ENTER_OVERLAY"
"""Set for a worker forked from this environment's warm launcher that is to run in an overlay
(``launch.training.spawn_worker``): JSON of the overlay's folder, its digest, and the
``PYTHONPATH`` its own Python would be started with."""


def overlay_entry(overlay) -> str:
    """``ENTER_OVERLAY``'s value for ``overlay``, read back by ``enter_overlay``."""
    from palaestra.launch.process import child_pythonpath

    return json.dumps(
        {
            "path": str(overlay.path),
            "digest": overlay.digest,
            "pythonpath": child_pythonpath(overlay.python),
        }
    )


def enter_overlay(entry: dict, argv: list[str]) -> None:
    """Run the rest of this worker, forked from this environment's warm launcher, in the
    overlay ``entry`` names (``launch.training.ENTER_OVERLAY``): its packages first on
    ``sys.path``, its variables set, as ``config.train()`` runs in one. Where the overlay holds
    its own version of a module imported here already (the launcher's), that version would
    come too late: the worker starts over as the overlay's Python instead, as it would have
    without a launcher."""
    from palaestra.overlay.environment import Overlay, activate_here, shadowed_modules

    overlay = Overlay(Path(entry["path"]), entry["digest"])
    shadowed = shadowed_modules(overlay, {name.partition(".")[0] for name in sys.modules})
    if not shadowed:
        activate_here(overlay)
        print("palaestra: image_overlay: forked from this environment's warm launcher")
        return
    print(
        "palaestra: image_overlay: its own "
        + ", ".join(shadowed[:3])
        + (" and more" if len(shadowed) > 3 else "")
        + " would come after this process imported this environment's; starting its Python",
        flush=True,
    )
    env = {**os.environ, **overlay.environment(), "PYTHONPATH": entry["pythonpath"]}
    python = str(overlay.python)
    os.execve(python, [python, "-m", "palaestra.launch.worker", *argv], env)


def main(argv: list[str]) -> None:
    entry = os.environ.pop(ENTER_OVERLAY, None)
    if entry is not None:
        enter_overlay(json.loads(entry), argv)
    install_signal_handlers()
    from transformers.utils import logging

    logging.disable_progress_bar()  # per-tensor loading bars would bury the step lines in train.log
    execute(RunDirectory(Path(argv[0])), resume="--resume" in argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter shutdown: it would join threads of a reward that hung, forever.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
