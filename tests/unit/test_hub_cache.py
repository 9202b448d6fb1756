"""A hub dataset read from the Hugging Face cache as the hub lays it out, with HF_HUB_OFFLINE=1:
the tutorial's ``HaikuDataset(hf_split="train[:10]")`` against a small dataset written here."""

from __future__ import annotations

from pathlib import Path

import pytest

from palaestra import HuggingFaceDataset
from palaestra.data import dataset as dataset_module
from palaestra.data.splits import DatasetError

REVISION = "0123456789abcdef0123456789abcdef01234567"


class HaikuDataset(HuggingFaceDataset):
    hf_repo = "statworx/haiku"
    input_column = "keywords"
    output_column = "text"
    output_format = "jsonl"
    apply_chat_template = True
    always_prepare = True
    prompt_template = "Write a haiku about {input}."


def write_hub_dataset(hf_home: Path, rows: int = 20) -> Path:
    """``statworx/haiku`` in the hub cache's layout, its train split in two parquet shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = hf_home / "hub" / "datasets--statworx--haiku"
    data = repo / "snapshots" / REVISION / "data"
    data.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    half = rows // 2
    for shard, (lo, hi) in enumerate([(0, half), (half, rows)]):
        table = pa.table(
            {
                "keywords": [f"topic {i}" for i in range(lo, hi)],
                "text": [f"line one\nline two {i}\nline three" for i in range(lo, hi)],
            }
        )
        pq.write_table(table, data / f"train-0000{shard}-of-00002.parquet")
    return repo


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def test_the_tutorials_slices_read_from_the_hub_cache_offline(hf_home):
    write_hub_dataset(hf_home)
    train = HaikuDataset(hf_split="train[:10]").load()
    assert [row["keywords"] for row in train] == [f"topic {i}" for i in range(10)]
    assert train[3]["text"] == "line one\nline two 3\nline three"
    evaluation = HaikuDataset(hf_split="train[10:15]").load()  # the second shard's first five
    assert [row["keywords"] for row in evaluation] == [f"topic {i}" for i in range(10, 15)]
    prompts = HaikuDataset(hf_split="train[:2]", apply_chat_template=False).prepare()
    assert prompts[1].text == "Write a haiku about topic 1."
    assert prompts[1].label == "line one\nline two 1\nline three"


def test_a_dataset_missing_from_the_cache_names_where_it_looked(hf_home):
    with pytest.raises(DatasetError) as error:
        HaikuDataset(hf_split="train[:10]").load()
    message = str(error.value)
    assert "HF_HUB_OFFLINE is set" in message
    assert str(hf_home / "hub" / "datasets--statworx--haiku") in message
    assert "hf download statworx/haiku --repo-type dataset" in message


def test_an_unreachable_hub_falls_back_to_the_cache(hf_home, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    write_hub_dataset(hf_home)
    asked = []

    def unreachable(repo, subset, split):
        asked.append(repo)
        raise ConnectionError(f"Couldn't reach '{repo}' on the Hub")

    monkeypatch.setattr(dataset_module, "_load_hub", unreachable)
    rows = HaikuDataset(hf_split="train[-3:]").load()
    assert asked == ["statworx/haiku"]
    assert [row["keywords"] for row in rows] == ["topic 17", "topic 18", "topic 19"]
