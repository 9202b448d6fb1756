"""The overlay environment: a virtual environment layered on the one palaestra runs in, built
once from an ``image_overlay``'s steps and cached under the palaestra home.

- **Layered**: it sees every package of the current environment (a ``.pth`` file adds the
  current venv's site-packages, ``.pth`` files and editable installs included, after its own;
  a Python that is not a venv is layered with ``--system-site-packages``) and adds its own,
  which come first.
- **Keyed** by a hash of the steps and of the environment it is layered on, under
  ``<home>/overlays/<key>``: a symbolic link, made atomically once the build succeeded, to the
  folder the build ran in (a venv cannot be moved once built: its scripts name their folder).
  A lock serialises two launches that build the same overlay; the second reuses the first's.
- **Commands run as written** by ``/bin/sh`` with the overlay's ``bin`` first on ``PATH``
  (``python``, ``pip`` and ``uv`` there act on it), ``VIRTUAL_ENV`` set, and ``UV_PYTHON`` set
  to its Python: ``uv pip install --system`` otherwise installs into the base interpreter the
  venv was made from, not into the venv. A command that fails (or runs past
  ``COMMAND_TIMEOUT_S``) fails the build with its exit code and last lines of output.

A process runs in the overlay with its Python and ``Overlay.environment()``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import venv
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from palaestra.atomic import write_json_atomic
from palaestra.home import palaestra_home
from palaestra.overlay.image import Step

OVERLAY_VAR = "PALAESTRA_OVERLAY"
"""Set in every process that runs in an overlay: the digest of its steps."""
COMMAND_TIMEOUT_S = 3600.0
"""Longest one overlay command may run before the build fails."""
TAIL_LINES = 20
"""Lines of a failed command's output its error shows."""


class OverlayBuildError(RuntimeError):
    """An ``image_overlay`` command failed while its environment was built."""


@dataclass(frozen=True)
class Overlay:
    """A built overlay environment, and how it came to be ready for this run."""

    path: Path
    """Its folder (``<home>/overlays/<key>``, or the running overlay's own prefix)."""
    digest: str
    """Hash of the steps it was built from."""
    env_vars: dict[str, str] = field(default_factory=dict)
    """Variables the steps set with ``image.env``."""
    built_s: float | None = None
    """Seconds this call spent building it; None: reused, nothing run."""

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def environment(self, path: str | None = None) -> dict[str, str]:
        """What a process running in the overlay adds to its environment (``path``: the
        ``PATH`` to put the overlay's ``bin`` in front of; this process's by default)."""
        path = os.environ.get("PATH", "") if path is None else path
        return {
            **self.env_vars,
            "PATH": os.pathsep.join(p for p in (str(self.path / "bin"), path) if p),
            "VIRTUAL_ENV": str(self.path),
            "UV_PYTHON": str(self.python),
            OVERLAY_VAR: self.digest,
        }

    def describe(self) -> str:
        """One line for train.log: built or reused, and where."""
        if self.built_s is None:
            return f"image_overlay: reused the environment at {self.path} (nothing run)"
        return f"image_overlay: built the environment at {self.path} in {self.built_s:.1f} s"


def steps_digest(steps: list[Step]) -> str:
    return hashlib.sha256(json.dumps(steps, sort_keys=True).encode()).hexdigest()[:16]


def base_sites() -> list[str]:
    """The site-packages folders of the environment an overlay is layered on (this one)."""
    sites = [p for p in site.getsitepackages() if os.path.isdir(p)]
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    return sites + ([user] if user and os.path.isdir(user) else [])


def overlay_key(steps: list[Step]) -> str:
    """The cache key: the steps and the environment they are layered on."""
    base = [sys.version, os.path.realpath(sys.executable), sys.prefix, base_sites()]
    return hashlib.sha256(json.dumps([steps, base], sort_keys=True).encode()).hexdigest()[:16]


def env_vars_of(steps: list[Step]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for step in steps:
        merged.update(step.get("env", {}))
    return merged


def ensure_overlay(steps: list[Step], home: Path | None = None) -> Overlay:
    """The overlay environment of ``steps``: this process's own when it already runs in it,
    the cached one when it exists, else built now (OverlayBuildError if a command fails)."""
    digest = steps_digest(steps)
    if os.environ.get(OVERLAY_VAR) == digest and sys.prefix != sys.base_prefix:
        return Overlay(Path(sys.prefix), digest, env_vars_of(steps))
    root = (home or palaestra_home()) / "overlays"
    root.mkdir(parents=True, exist_ok=True)
    link = root / overlay_key(steps)
    if (link / "overlay.json").is_file():
        return Overlay(link, digest, env_vars_of(steps))
    with open(root / f"{link.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent build of the same overlay: wait for it
        if (link / "overlay.json").is_file():
            return Overlay(link, digest, env_vars_of(steps))
        started = time.monotonic()
        folder = Path(tempfile.mkdtemp(prefix=f"{link.name}.", dir=root))
        try:
            _build(folder, steps)
            write_json_atomic(
                folder / "overlay.json",
                {"digest": digest, "steps": steps, "base": sys.prefix, "built_at": time.time()},
            )
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        temporary = root / f".{link.name}.link"
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(folder.name)
        os.replace(temporary, link)  # atomic: readers see no overlay or a complete one
    return Overlay(link, digest, env_vars_of(steps), time.monotonic() - started)


def _build(folder: Path, steps: list[Step]) -> None:
    layered_on_venv = sys.prefix != sys.base_prefix
    venv.EnvBuilder(with_pip=False, symlinks=True, system_site_packages=not layered_on_venv).create(
        folder
    )
    overlay = Overlay(folder, "")
    purelib = Path(_purelib(overlay.python))
    if layered_on_venv:
        lines = [f"import site; site.addsitedir({p!r})" for p in base_sites()]
        (purelib / "_palaestra_base.pth").write_text("\n".join(lines) + "\n")
    _add_tools(folder / "bin")
    variables: dict[str, str] = {}
    count, number = sum("run" in step for step in steps), 0
    for step in steps:
        variables.update(step.get("env", {}))
        if "run" in step:
            number += 1
            environment = {**os.environ, **variables, **overlay.environment()}
            environment.pop("PYTHONHOME", None)
            _run(step, f"{number} of {count}", environment, folder / "build.log")


def _purelib(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def _add_tools(bin_folder: Path) -> None:
    """``pip`` (this environment's, acting on the overlay's Python) and ``uv`` on its PATH."""
    if importlib.util.find_spec("pip") is not None:
        for name in ("pip", "pip3"):
            script = bin_folder / name
            script.write_text(f'#!/bin/sh\nexec "{bin_folder}/python" -m pip "$@"\n')
            script.chmod(0o755)
    if importlib.util.find_spec("uv") is not None:
        from uv import find_uv_bin

        (bin_folder / "uv").symlink_to(find_uv_bin())


def _run(step: Step, which: str, environment: dict[str, str], log: Path) -> None:
    command = step["run"]
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with open(log, "a") as out:
        out.write(f"$ {command}\n")
        out.flush()
        process = subprocess.Popen(
            ["/bin/sh", "-c", command],
            cwd=step.get("cwd"),
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # a timeout ends the command and whatever it started
        )

        def copy() -> None:
            for line in process.stdout:
                out.write(line)
                tail.append(line.rstrip("\n"))

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        try:
            code = process.wait(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
            tail.append(f"(killed after {COMMAND_TIMEOUT_S:.0f} s)")
        reader.join(timeout=5)
    if code != 0:
        shown = "\n".join(f"    {line}" for line in list(tail)) or "    (no output)"
        raise OverlayBuildError(
            f"image_overlay command {which} failed with exit code {code}: {command}\n"
            f"  its last {len(tail)} line(s) of output:\n{shown}"
        )


def shadowed_modules(overlay: Overlay, names) -> list[str]:
    """Those of the top-level modules ``names`` (imported here already) that the overlay's
    own packages provide in another version than this environment's: activating the overlay
    would not replace them. (An installer that does not look past the overlay's own folder
    puts the same version of a shared dependency in it: that one is no conflict.)"""
    from importlib import metadata
    from importlib.machinery import PathFinder

    purelib = _purelib(overlay.python)
    found = [name for name in set(names) if PathFinder.find_spec(name, [purelib])]
    if not found:
        return []
    theirs: dict[str, tuple[str, str]] = {}  # top-level name -> (distribution, version)
    for dist in metadata.distributions(path=[purelib]):
        which = (dist.metadata["Name"], dist.version)
        for top in {file.parts[0].removesuffix(".py") for file in dist.files or ()}:
            theirs.setdefault(top, which)
    shadowed = []
    for name in found:
        dist, version = theirs.get(name, (None, None))
        try:
            same = dist is not None and metadata.version(dist) == version  # this environment's
        except metadata.PackageNotFoundError:
            same = False
        if not same:
            shadowed.append(name)
    return sorted(shadowed)


def activate_here(overlay: Overlay) -> None:
    """Run the rest of this process in ``overlay``: its packages first on ``sys.path``, its
    variables in ``os.environ`` (for a run trained in the caller's own process)."""
    purelib = _purelib(overlay.python)
    before = list(sys.path)
    site.addsitedir(purelib)  # its .pth files too
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + before
    os.environ.update(overlay.environment())
