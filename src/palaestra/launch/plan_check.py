"""The caller's plan check (``plan.check_plan``), run in a process forked from a warm launcher.

``config.launch()`` refuses a run whose plan does not fit before any process starts. Planning
reads the model's tokenizer through transformers and this CPU's precision through torch, so in
a script that has imported neither, ``launch()`` spent 5 to 7 s importing them before it
returned (2-core AVX2 EPYC; the tutorial's first run), and kept them in the script's memory.
Where a warm launcher of this interpreter and environment is ready (``launch.warm``: a script
that served an endpoint first, as the tutorial does), the check runs in a process forked from
it, with those imports done; the caller waits for its verdict. Anywhere else, or where that
process fails to give one, the check runs in the caller as before.

The config goes to the forked process signed (``runs.trust``), in a private temporary folder;
the verdict comes back as JSON beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TIMEOUT_S = 300.0
"""How long the caller waits for a verdict before it checks the plan itself."""


def check_in_launcher(config) -> bool:
    """Check ``config``'s plan in a process forked from a ready warm launcher: True where it
    fits; ``PlanDoesNotFitError`` where it does not; False where no launcher is ready or the
    process gave no verdict (the caller then checks it itself)."""
    import cloudpickle

    from palaestra.launch.process import spawn_module
    from palaestra.plan import PlanDoesNotFitError
    from palaestra.runs.trust import write_signed

    with tempfile.TemporaryDirectory(prefix="palaestra-plan-") as scratch:
        request, verdict = Path(scratch, "config.pkl"), Path(scratch, "verdict.json")
        write_signed(request, cloudpickle.dumps(config))
        log = Path(scratch, "check.log")
        process = spawn_module(__name__, [str(request), str(verdict)], log, warm_only=True)
        if process is None:
            return False
        try:
            code = process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            from palaestra.launch.process import stop_process

            stop_process(process.pid, process.start_time, timeout=5.0)
            return False
        if code != 0 or not verdict.is_file():
            return False
        refusal = json.loads(verdict.read_text())["refusal"]
    if refusal is not None:
        raise PlanDoesNotFitError(refusal)
    return True


def main(argv: list[str]) -> None:
    import cloudpickle

    from palaestra.atomic import write_json_atomic
    from palaestra.plan import PlanDoesNotFitError, check_plan
    from palaestra.runs.trust import read_signed

    request, verdict = (Path(arg) for arg in argv)
    config = cloudpickle.loads(read_signed(request))
    try:
        check_plan(config)
        refusal = None
    except PlanDoesNotFitError as error:
        refusal = str(error)
    write_json_atomic(verdict, {"refusal": refusal})


if __name__ == "__main__":
    main(sys.argv[1:])
    # The verdict is written: skip the interpreter's shutdown, which in a process holding
    # torch's and transformers' modules took longer (1.5 s) than the check itself.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
