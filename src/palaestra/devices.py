"""What a device can hold and do: a GPU model's memory and peaks (from a table of the
vendors' figures), or this machine's CPU, its memory and its matmul and copy rates measured
on the spot. The plan (``palaestra.plan``) reads them; nothing here loads torch at import.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class Gpu:
    """A GPU model's memory and peaks (dense bfloat16, no sparsity)."""

    name: str
    memory_bytes: int
    bf16_flops: float
    bandwidth: float
    """Bytes per second."""


GPUS = {
    # NVIDIA's data sheets (SXM parts); memory as nvidia-smi reports it.
    "H100": Gpu("H100-80GB", 81559 * 1024**2, 989e12, 3.35e12),
    "H200": Gpu("H200-141GB", 143771 * 1024**2, 989e12, 4.8e12),
    "A100": Gpu("A100-80GB", 81920 * 1024**2, 312e12, 2.04e12),
    "L40S": Gpu("L40S-48GB", 46068 * 1024**2, 362e12, 0.864e12),
}


@dataclass(frozen=True)
class Device:
    """The device a plan is for: its name, memory per device, and peaks."""

    name: str
    memory_bytes: int
    peak_flops: float
    bandwidth: float
    bf16: bool
    """Whether ``precision="auto"`` resolves to bfloat16 on it."""


def gpu_device(name: str | None) -> Device:
    """A GPU of ``GPUS`` by name (``"H100"``), or this machine's first CUDA GPU."""
    if name is None:
        import torch

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "H100"
    for key, gpu in GPUS.items():
        if re.search(key, name, re.IGNORECASE):
            return Device(gpu.name, gpu.memory_bytes, gpu.bf16_flops, gpu.bandwidth, True)
    raise ValueError(f"no peaks known for GPU {name!r}; known: {', '.join(GPUS)}")


def cpu_device(precision: str, measure: bool = True) -> Device:
    """This machine's CPU: its memory, and its matmul and copy rates measured (``measure``)."""
    import torch

    from palaestra.models.loading import compute_dtype

    bf16 = compute_dtype("auto", "cpu") == torch.bfloat16
    dtype = torch.bfloat16 if (precision == "bfloat16" or (precision == "auto" and bf16)) else None
    flops, bandwidth = measure_cpu(dtype or torch.float32) if measure else (1.0, 1.0)
    total, available = host_memory()
    name = f"CPU ({os.cpu_count()} cores, {available / GIB:.2f} GiB of memory available now)"
    return Device(name, total, flops, bandwidth, bf16)


def measure_cpu(dtype, size: int = 1024, repeats: int = 3) -> tuple[float, float]:
    """Best observed matmul FLOP/s in ``dtype`` and copy bytes/s (read + write) here."""
    import time

    import torch

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    flops = 2 * size**3 / best
    source = torch.ones(32 * 1024**2, dtype=torch.float32)  # 128 MiB, past any cache
    target = torch.zeros_like(source)  # written once, so no page is first touched when timed
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return flops, 2 * source.nbytes / best


def host_memory() -> tuple[int, int]:
    """This machine's memory and what is available to a new process now, in bytes. A run is
    refused against the total, never against what other processes happen to hold."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = total
    try:
        with open("/proc/meminfo") as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return total, available


DEVICE_VAR = "PALAESTRA_DEVICE"
"""The rehearsal switch: ``PALAESTRA_DEVICE=cpu`` runs a GPU layout (``rollout_num_gpus``) with
CPU devices and gloo. Ray still places and counts the GPUs (a Ray instance can declare GPUs it
does not have), so the layout, its placement and its failures rehearse on a CPU machine."""


def rehearsing() -> bool:
    """Whether ``PALAESTRA_DEVICE=cpu`` asks for CPU devices in place of the recipe's GPUs."""
    value = os.environ.get(DEVICE_VAR, "").strip().lower()
    if value not in ("", "cpu", "cuda"):
        raise ValueError(f"{DEVICE_VAR}={value!r}: set it to 'cpu' (the rehearsal) or unset it")
    return value == "cpu"


def torch_device_type(rollout_num_gpus: int) -> str:
    """``"cuda"`` or ``"cpu"``: where a run's torch work goes. The one place that reads the
    rehearsal switch; the engines' device (``backends.building.device_of``) and the learner's
    ranks (``train.sharded_driver.join_group``) both ask it."""
    return "cuda" if rollout_num_gpus and not rehearsing() else "cpu"


def rehearsal_env() -> dict[str, str]:
    """The switch as environment variables for processes that do not inherit this one's (Ray
    actors take their environment from the raylet, not from the driver)."""
    return {DEVICE_VAR: "cpu"} if rehearsing() else {}
