"""Whether the process a record names is still running.

Run status and endpoint records store a pid with the process's start time, because pids are
reused: a record whose process died must not look alive because a later process got its pid.
Reading this needs no control over the process, so the store owns it; ``launch/`` spawns and
stops processes and records them with ``process_start_time``.
"""

from __future__ import annotations

import os


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name, or None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot: tells a process from a later one that
    reuses its pid."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


def pid_alive(pid: int | None, start_time: int | None = None) -> bool:
    """Whether ``pid`` runs and, given ``start_time``, is still the process that had it."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _proc_stat(pid)
    if fields is None:
        return True
    if fields[0] == "Z":  # exited, not yet reaped by its parent
        return False
    return start_time is None or int(fields[19]) == start_time
