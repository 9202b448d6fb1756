"""A Ray instance held by a child process for as long as a test needs it: the tests reach it by
its address, as a user's run reaches a cluster, and no Ray state lives in the pytest process."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator

HOLD = """
import json, sys, ray
options = json.loads(sys.argv[1])
context = ray.init(address="local", include_dashboard=False, **options)
print(context.address_info["gcs_address"], flush=True)
sys.stdin.read()  # held until the test closes stdin
ray.shutdown()
"""


@contextlib.contextmanager
def held_ray_instance(env: dict[str, str] | None = None, **options) -> Iterator[str]:
    """The GCS address of a local Ray instance started with ``ray.init(**options)`` (logical
    ``num_gpus`` need no GPU) in a child process with environment ``env``; shut down after."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, json.dumps(options)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        address = holder.stdout.readline().strip()
        assert address, "the Ray instance did not start"
        yield address
    finally:
        holder.stdin.close()
        holder.wait(timeout=120)
