"""palaestra's home: a second home shares the usual one's converted models."""

from __future__ import annotations

from palaestra.home import palaestra_home, share_usual_home


def test_a_second_home_reads_and_writes_the_usual_homes_models(tmp_path, monkeypatch):
    usual, other = tmp_path / "usual", tmp_path / "other"
    monkeypatch.setenv("PALAESTRA_HOME", str(usual))
    other.mkdir()
    share_usual_home(other, ("models", "overlays"))
    assert palaestra_home() == usual
    assert (usual / "models").is_dir() and (usual / "overlays").is_dir()  # made where missing
    (other / "models" / "converted.txt").write_text("weights")
    assert (usual / "models" / "converted.txt").read_text() == "weights"
    assert sorted(p.name for p in other.iterdir()) == ["models", "overlays"]
    assert not (other / "runs").exists()  # only what was named is shared
