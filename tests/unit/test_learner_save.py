"""A learner's saved optimiser state: written without zip checksums, loaded back whole."""

from __future__ import annotations

import zipfile

import torch

from palaestra import Recipe
from palaestra.checkpoints import OPTIMIZER_FILE
from palaestra.train.learner import Learner
from tests.support.tiny_models import build_tiny_model, build_tokenizer


def test_the_optimiser_state_is_saved_without_checksums_and_loads_back_the_same(tmp_path):
    tokenizer = build_tokenizer()
    learner = Learner(build_tiny_model(tokenizer, seed=3), Recipe(lr=1e-3), tokenizer=tokenizer)
    for parameter in learner.model.parameters():  # one step: moments to save
        parameter.grad = torch.randn_like(parameter)
    learner.optimizer.step()
    learner.save(tmp_path)

    with zipfile.ZipFile(tmp_path / OPTIMIZER_FILE) as archive:
        records = [info for info in archive.infolist() if "/data/" in info.filename]
        assert records and all(info.CRC == 0 for info in records)  # torch.load never checks them
    again = Learner(build_tiny_model(tokenizer, seed=3), Recipe(lr=1e-3), tokenizer=tokenizer)
    again.load(tmp_path)
    saved, loaded = learner.optimizer.state_dict(), again.optimizer.state_dict()
    assert saved["state"].keys() == loaded["state"].keys()
    for index, moments in saved["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, loaded["state"][index][name]), (index, name)
