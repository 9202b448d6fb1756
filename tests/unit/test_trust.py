"""Signed run pickles: only what this home wrote (or its user trusted) is loaded."""

from __future__ import annotations

import shutil
import stat

import pytest

from palaestra.runs.trust import (
    MAGIC,
    UntrustedPickleError,
    home_key,
    read_signed,
    trust,
    write_signed,
)


def test_a_signed_payload_reads_back_and_the_key_is_private(home, tmp_path):
    path = tmp_path / "config.pkl"
    write_signed(path, b"payload bytes")
    assert read_signed(path) == b"payload bytes"
    key_file = home / "trust.key"
    assert len(key_file.read_bytes()) == 32
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert home_key() == key_file.read_bytes()  # made once, then reused


def test_a_changed_payload_is_refused(home, tmp_path):
    path = tmp_path / "config.pkl"
    write_signed(path, b"reward = safe")
    data = path.read_bytes()
    path.write_bytes(data.replace(b"safe", b"evil"))
    with pytest.raises(UntrustedPickleError, match="changed after it was written"):
        read_signed(path)


def test_an_unsigned_pickle_is_refused_until_trusted(home, tmp_path):
    run = tmp_path / "run-1"
    run.mkdir()
    path = run / "config.pkl"
    path.write_bytes(b"plain pickle")
    with pytest.raises(UntrustedPickleError) as caught:
        read_signed(path)
    message = str(caught.value)
    assert "is not signed" in message and "palaestra run trust run-1" in message
    trust(path)
    assert read_signed(path) == b"plain pickle"
    assert path.read_bytes().startswith(MAGIC)


def test_another_homes_signature_is_refused(tmp_path, monkeypatch):
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir(), theirs.mkdir()
    path = tmp_path / "config.pkl"
    write_signed(path, b"their reward", home=theirs)
    assert read_signed(path, home=theirs) == b"their reward"
    with pytest.raises(UntrustedPickleError, match="not signed by this palaestra home"):
        read_signed(path, home=mine)


def test_a_run_copied_from_another_home_is_not_resumed(tiny_model_dir, tmp_path, monkeypatch):
    from palaestra.launch.training import TrainingRun, create_run
    from palaestra.launch.worker import execute
    from tests.support.tiny_runs import tiny_config, write_topics

    monkeypatch.setenv("PALAESTRA_HOME", str(tmp_path / "theirs"))
    data = write_topics(tmp_path / "topics.jsonl")
    run = create_run(tiny_config(tiny_model_dir, data))
    run.update_status(state="failed")

    monkeypatch.setenv("PALAESTRA_HOME", str(tmp_path / "mine"))
    copied = tmp_path / "mine" / "runs" / run.run_id
    shutil.copytree(run.path, copied)
    handle = TrainingRun.from_id(run.run_id)
    with pytest.raises(UntrustedPickleError, match="not signed by this palaestra home"):
        handle.resume()
    assert handle.status == "failed"  # nothing was started or claimed

    # The worker refuses too (a process started some other way), and says why in the status.
    execute(handle._run, resume=True)
    assert "UntrustedPickleError" in handle.status_info()["error"]

    trust(copied / "config.pkl")
    assert read_signed(copied / "config.pkl")  # now loads: the user vouched for it


def test_the_cli_trusts_a_run_by_id(home, capsys):
    from palaestra.cli import main

    run = home / "runs" / "run-7"
    run.mkdir(parents=True)
    (run / "config.pkl").write_bytes(b"copied pickle")
    assert main(["run", "trust", "run-7"]) == 0
    assert "run-7" in capsys.readouterr().out
    assert read_signed(run / "config.pkl") == b"copied pickle"
    assert main(["run", "trust", "run-8"]) == 1
    assert "no run run-8" in capsys.readouterr().err
