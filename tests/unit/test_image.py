"""The stand-in image an ``image_overlay`` is given: the calls it records as steps, and the
calls it refuses, naming them and what to do instead."""

from __future__ import annotations

import pytest

from palaestra import Recipe
from palaestra.overlay import ImageOverlayError, overlay_steps
from palaestra.recipes import check_runnable_here

TUTORIAL_OVERLAY = lambda image: image.run_commands(  # noqa: E731 (the tutorial's own form)
    "uv pip install --system aiohttp 'nltk>=3.8.0'",
    "python -c \"import nltk; nltk.download('cmudict', quiet=True)\"",
)


async def reward(args, sample, **kwargs) -> float:
    return 0.0


def test_the_tutorials_commands_are_recorded_as_written():
    assert overlay_steps(TUTORIAL_OVERLAY) == [
        {"run": "uv pip install --system aiohttp 'nltk>=3.8.0'"},
        {"run": "python -c \"import nltk; nltk.download('cmudict', quiet=True)\""},
    ]
    assert overlay_steps(None) is None


def test_builder_calls_become_commands_and_variables(tmp_path):
    (tmp_path / "req.txt").write_text("six\n")
    steps = overlay_steps(
        lambda image: (
            image.pip_install("a==1", ["b"], find_links="/wheels", pre=True)
            .uv_pip_install("c d", extra_options="--no-index")
            .env({"LEVEL": 3})
            .workdir(str(tmp_path))
            .pip_install_from_requirements(str(tmp_path / "req.txt"))
            .run_commands("echo hi", gpu="H100")
        )
    )
    assert steps == [
        {"run": "python -m pip install --find-links /wheels --pre a==1 b"},
        {"run": "uv pip install --system 'c d' --no-index"},
        {"env": {"LEVEL": "3"}},
        {"run": f"python -m pip install -r {tmp_path / 'req.txt'}", "cwd": str(tmp_path)},
        {"run": "echo hi", "cwd": str(tmp_path)},
    ]


def test_apt_install_is_refused_naming_it_and_what_to_do_instead():
    with pytest.raises(ImageOverlayError) as error:
        overlay_steps(lambda image: image.run_commands("true").apt_install("git", "curl"))
    message = str(error.value)
    assert "image.apt_install('git', 'curl')" in message
    assert "sudo apt-get install git curl" in message
    assert "remove apt_install from image_overlay" in message


def test_unknown_calls_and_secrets_are_refused():
    with pytest.raises(ImageOverlayError, match=r"image.shell\(\), which palaestra does not map"):
        overlay_steps(lambda image: image.shell())
    with pytest.raises(ImageOverlayError, match="Modal secrets do not exist here"):
        overlay_steps(lambda image: image.run_commands("true", secrets=["token"]))
    with pytest.raises(ImageOverlayError, match="with timeout"):
        overlay_steps(lambda image: image.pip_install("x", timeout=3))


def test_the_recipe_accepts_the_tutorials_overlay_on_every_backend_and_records_it():
    for backend in ("local", "ray"):
        recipe = Recipe(custom_rm_function=reward, backend=backend, image_overlay=TUTORIAL_OVERLAY)
        check_runnable_here(recipe)
        assert recipe.to_json_dict()["image_overlay"] == overlay_steps(TUTORIAL_OVERLAY)
    bad = Recipe(custom_rm_function=reward, image_overlay=lambda image: image.apt_install("git"))
    with pytest.raises(ImageOverlayError, match="apt_install"):
        check_runnable_here(bad)
