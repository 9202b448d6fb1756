"""Image: what a recipe's ``image_overlay`` is given in place of a container image.

In the Training Gym, ``image_overlay=lambda image: image.run_commands(...)`` customises the
``modal.Image`` a run executes in. palaestra has no image: a run executes in an overlay
environment (``overlay/environment.py``), a virtual environment layered on the one palaestra is
installed in. ``Image`` records the builder calls the Gym's examples use as plain, JSON-able
steps for that environment to replay:

- ``run_commands(*commands)``: each command, run as written by ``/bin/sh`` in the overlay
  environment (its ``bin`` first on ``PATH``, ``VIRTUAL_ENV`` and ``UV_PYTHON`` set), so
  ``pip install``, ``uv pip install --system`` and ``python -c`` act on it.
- ``pip_install(*packages)`` / ``uv_pip_install(*packages)``: the same as the command
  ``python -m pip install ...`` / ``uv pip install --system ...`` with the given options.
- ``pip_install_from_requirements(path)``: ``python -m pip install -r path``.
- ``env({...})``: variables set for the commands after it and for the run itself.
- ``workdir(path)``: the folder the commands after it run in.

A call with no meaning outside a container (``apt_install``, ``add_local_dir``...) is an
``ImageOverlayError`` naming it and what to do instead, never skipped in silence.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any


class ImageOverlayError(ValueError):
    """An ``image_overlay`` calls something palaestra cannot do outside a container image."""


Step = dict[str, Any]
"""One recorded call: ``{"run": command}`` (with ``"cwd"`` when a workdir was set),
``{"env": {name: value}}``."""

_SUPPORTED = (
    "run_commands, pip_install, uv_pip_install, pip_install_from_requirements, env, workdir"
)

_NO_LOCAL_MEANING = {
    "apt_install": (
        "installs system packages into a container image with apt-get; here that would need "
        "root and change the machine for every program. Install them yourself (sudo apt-get "
        "install {args}) on every machine the run uses, then remove apt_install from "
        "image_overlay"
    ),
    "add_local_dir": (
        "copies local files into a container image; a run here reads them where they are. "
        "Remove it and use the local path directly"
    ),
    "add_local_file": (
        "copies a local file into a container image; a run here reads it where it is. Remove "
        "it and use the local path directly"
    ),
    "add_local_python_source": (
        "copies local modules into a container image; a run here imports them from where the "
        "launching script does. Remove it"
    ),
    "micromamba_install": (
        "installs conda packages into a container image. Install them into this environment "
        "yourself, or use pip_install for their PyPI equivalents"
    ),
    "dockerfile_commands": (
        "runs Dockerfile instructions; there is no Dockerfile here. Use run_commands with the "
        "RUN lines' shell commands"
    ),
}


class Image:
    """The stand-in image an ``image_overlay`` customises: each builder call appends steps and
    returns the image, so chained calls work as on a ``modal.Image``."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self._cwd: str | None = None

    def run_commands(self, *commands: str | list[str], **options: Any) -> Image:
        """Shell commands, each run as written in the overlay environment."""
        self._check_options("run_commands", options)
        for command in _flatten(commands):
            self.steps.append({"run": command, **({"cwd": self._cwd} if self._cwd else {})})
        return self

    def pip_install(self, *packages: str | list[str], **options: Any) -> Image:
        """``python -m pip install`` of ``packages`` (index, find-links and pre options too)."""
        return self._install("pip_install", ["python", "-m", "pip", "install"], packages, options)

    def uv_pip_install(self, *packages: str | list[str], **options: Any) -> Image:
        """``uv pip install --system`` of ``packages``; ``uv`` comes with palaestra."""
        return self._install(
            "uv_pip_install", ["uv", "pip", "install", "--system"], packages, options
        )

    def pip_install_from_requirements(self, requirements_txt: str, **options: Any) -> Image:
        """``python -m pip install -r requirements_txt``, the file resolved here, now."""
        path = str(Path(requirements_txt).expanduser().resolve())
        base = ["python", "-m", "pip", "install", "-r", path]
        return self._install("pip_install_from_requirements", base, (), options)

    def env(self, variables: dict[str, Any]) -> Image:
        """Environment variables for the commands after this call and for the run."""
        self.steps.append({"env": {str(k): str(v) for k, v in variables.items()}})
        return self

    def workdir(self, path: str) -> Image:
        """The folder the commands after this call run in."""
        self._cwd = str(Path(path).expanduser())
        return self

    def _install(self, name: str, base: list[str], packages: tuple, options: dict) -> Image:
        words = list(base)
        for option, flag in (
            ("index_url", "--index-url"),
            ("extra_index_url", "--extra-index-url"),
            ("find_links", "--find-links"),
        ):
            if options.get(option):
                words += [flag, str(options.pop(option))]
        if options.pop("pre", False):
            words.append("--pre")
        extra = options.pop("extra_options", "") or ""
        self._check_options(name, options)
        command = shlex.join(words + _flatten(packages))
        return self.run_commands(command + (f" {extra}" if extra else ""))

    @staticmethod
    def _check_options(name: str, options: dict[str, Any]) -> None:
        # A container build's GPU and forced rebuild do not change what a command does here.
        options = {k: v for k, v in options.items() if k not in ("gpu", "force_build")}
        if options.get("secrets"):
            raise ImageOverlayError(
                f"image_overlay calls image.{name}(secrets=...): Modal secrets do not exist "
                "here; set the variables the commands need with image.env({...}) or in the "
                "environment that launches the run"
            )
        options.pop("secrets", None)
        if options:
            raise ImageOverlayError(
                f"image_overlay calls image.{name}() with {', '.join(sorted(options))}, which "
                "palaestra does not know how to apply here"
            )

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def refuse(*args: Any, **kwargs: Any):
            reason = _NO_LOCAL_MEANING.get(name)
            shown = " ".join(str(a) for a in _flatten(args))
            raise ImageOverlayError(
                f"image_overlay calls image.{name}({', '.join(map(repr, args))}), which "
                + (
                    reason.format(args=shown)
                    if reason
                    else f"palaestra does not map; the image's calls it runs are {_SUPPORTED}"
                )
            )

        return refuse


def overlay_steps(image_overlay: Callable[[Image], Any] | None) -> list[Step] | None:
    """The steps ``image_overlay`` records, or None without one; ImageOverlayError for a call
    that has no meaning here."""
    if image_overlay is None:
        return None
    if not callable(image_overlay):
        raise ImageOverlayError(
            f"image_overlay must be a function of the image (lambda image: "
            f"image.run_commands(...)), got {image_overlay!r}"
        )
    image = Image()
    image_overlay(image)
    return image.steps


def _flatten(items: tuple) -> list[str]:
    out: list[str] = []
    for item in items:
        out += [str(i) for i in item] if isinstance(item, list | tuple) else [str(item)]
    return out
