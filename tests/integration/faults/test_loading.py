"""Loading a checkpoint runs no pickled code, and a checkpoint whose files are malformed,
truncated or of another model fails naming the file, through the paths users take: continuing
training from it (``TrainConfig(checkpoint=...).train()``), serving it (``Endpoint.launch``,
``palaestra serve``)."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from palaestra import ModelConfig, RunFailedError
from palaestra.runs.registry import open_run
from tests.support.tiny_runs import tiny_config, write_topics


class WritesMarker:
    """Unpickling this calls ``open(marker, "w")``: a file appears if any code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_topics(tmp_path_factory.mktemp("data") / "topics.jsonl")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_model_dir, data) -> Path:
    """A complete step-1 checkpoint of the tiny model (in a home of its own: tests copy it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PALAESTRA_HOME", str(tmp_path_factory.mktemp("source-home")))
        result = tiny_config(tiny_model_dir, data, num_rollout=1).train()
    return result.checkpoints()[-1].path


def copy_of(checkpoint: Path, tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(checkpoint, folder)
    return folder


def continue_from(folder: Path, tiny_model_dir: Path, data: Path) -> str:
    """Train one step from ``folder``; the run's error (it must fail), after checking the run
    got no further than loading."""
    config = tiny_config(tiny_model_dir, data, num_rollout=1)
    with pytest.raises(RunFailedError) as failure:
        config.model_copy(update={"checkpoint": folder}).train()
    run_id = str(failure.value).split()[1]
    run = open_run(run_id)
    assert run.metrics() == [] and run.checkpoint_paths() == []
    assert run.read_status()["error"] in str(failure.value)
    return str(failure.value)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("write", ["torch.save", "pickle"])
def test_a_pickled_object_in_optimizer_pt_is_refused_unrun(
    write, home, tmp_path, tiny_model_dir, data, checkpoint
):
    marker = tmp_path / "marker"
    # The payload is live: plain unpickling writes the marker.
    pickle.loads(pickle.dumps(WritesMarker(marker)))
    assert marker.exists()
    marker.unlink()

    folder = copy_of(checkpoint, tmp_path, "evil")
    payload = {"optimizer": WritesMarker(marker)}
    if write == "torch.save":
        torch.save(payload, folder / "optimizer.pt")
    else:
        (folder / "optimizer.pt").write_bytes(pickle.dumps(payload))
    error = continue_from(folder, tiny_model_dir, data)
    assert f"{folder / 'optimizer.pt'}: holds more than tensors" in error
    assert not marker.exists()


def test_a_pickled_object_in_pytorch_model_bin_is_refused_unrun(
    home, tmp_path, tiny_model_dir, data, checkpoint
):
    """Weights in the older .bin format are read by transformers with weights_only too."""
    marker = tmp_path / "marker"
    folder = copy_of(checkpoint, tmp_path, "evil-bin")
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": WritesMarker(marker)}, folder / "pytorch_model.bin")
    error = continue_from(folder, tiny_model_dir, data)
    assert f"{folder}: cannot load the weights" in error
    assert not marker.exists()


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def wider_model(folder: Path) -> torch.nn.Module:
    """A model as ``folder``'s config.json describes, but 48 wide instead of 32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    config.hidden_size, config.head_dim = 48, 24
    return AutoModelForCausalLM.from_config(config)


def other_model_weights(folder: Path) -> None:
    """model.safetensors of the wider model under the 32-wide one's config.json."""
    state = wider_model(folder).state_dict()
    tensors = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}  # tied
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def other_model_optimizer(folder: Path) -> None:
    """optimizer.pt of AdamW after a step of the wider model (as many parameters)."""
    wide = wider_model(folder)
    optimizer = torch.optim.AdamW(wide.parameters())
    wide(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    torch.save({"optimizer": optimizer.state_dict()}, folder / "optimizer.pt")


CORRUPTIONS = {
    "truncated model.safetensors": (
        lambda f: truncate(f / "model.safetensors"),
        "model.safetensors",
        "incomplete metadata",
    ),
    "model.safetensors of another hidden size": (
        other_model_weights,
        "model.safetensors",
        "model.embed_tokens.weight has shape (99, 48), but config.json makes it (99, 32)",
    ),
    "garbage trainer_state.json": (
        lambda f: (f / "trainer_state.json").write_text("{step: 1,"),
        "trainer_state.json",
        "not valid JSON",
    ),
    "binary trainer_state.json": (
        lambda f: (f / "trainer_state.json").write_bytes(b"\x80\xff\x00"),
        "trainer_state.json",
        "not valid JSON",
    ),
    "trainer_state.json not an object": (
        lambda f: (f / "trainer_state.json").write_text("[1, 2]"),
        "trainer_state.json",
        "a JSON list, not an object",
    ),
    "trainer_state.json step of the wrong type": (
        lambda f: (f / "trainer_state.json").write_text(json.dumps({"step": "1"})),
        "trainer_state.json",
        "step is '1', not a whole number >= 0",
    ),
    "truncated optimizer.pt": (
        lambda f: truncate(f / "optimizer.pt"),
        "optimizer.pt",
        "PytorchStreamReader failed",
    ),
    "optimizer.pt of another hidden size": (
        other_model_optimizer,
        "optimizer.pt",
        "has shape (99, 48), but the model's parameter 0 has shape (99, 32)",
    ),
    "garbage tokenizer.json": (
        lambda f: (f / "tokenizer.json").write_text("{ broken"),
        "",  # the tokenizer's files are read together: the folder is named
        "cannot load the tokenizer",
    ),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_broken_checkpoint_fails_training_naming_the_file(
    corruption, home, tmp_path, tiny_model_dir, data, checkpoint
):
    corrupt, file, reason = CORRUPTIONS[corruption]
    folder = copy_of(checkpoint, tmp_path, "broken")
    corrupt(folder)
    error = continue_from(folder, tiny_model_dir, data)
    assert f"{folder / file if file else folder}: " in error
    assert reason in error


def test_an_endpoint_of_a_truncated_checkpoint_fails_naming_the_file(
    home, tmp_path, tiny_model_dir, checkpoint
):
    from palaestra.serve import Endpoint
    from palaestra.serve.endpoint import EndpointError

    folder = copy_of(checkpoint, tmp_path, "truncated")
    truncate(folder / "model.safetensors")
    tiny = ModelConfig(name="tiny", source=str(tiny_model_dir))
    endpoint = Endpoint.launch(tiny, checkpoint=folder, name="truncated")
    try:
        with pytest.raises(EndpointError, match="failed: its process exited") as failure:
            endpoint.wait_until_ready(timeout=120)
    finally:
        endpoint.stop()
    assert f"{folder / 'model.safetensors'}: cannot load the weights" in str(failure.value)


def test_garbage_palaestra_json_fails_serving_naming_the_file(
    home, tmp_path, tiny_model_dir, checkpoint, capsys
):
    from palaestra.cli import main
    from palaestra.serve import Endpoint

    folder = copy_of(checkpoint, tmp_path, "garbage-info")
    (folder / "palaestra.json").write_text("{")
    tiny = ModelConfig(name="tiny", source=str(tiny_model_dir))
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'palaestra.json'}: not valid JSON")):
        Endpoint.launch(tiny, checkpoint=folder)
    assert main(["serve", str(folder), "--port", "0"]) == 1
    assert f"{folder / 'palaestra.json'}: not valid JSON" in capsys.readouterr().err
    assert not list((home / "endpoints").glob("*.json"))
