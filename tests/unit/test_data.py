"""Datasets: split slicing, local file formats and layouts, columns, prompts, the prepared cache."""

from __future__ import annotations

import csv
import json
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from palaestra.data import (
    DatasetConfig,
    DatasetError,
    HuggingFaceDataset,
    LocalDataset,
    builtin_dataset,
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def numbered(n: int, split: str = "train") -> list[dict]:
    return [{"input": f"{split}-{i}", "i": i} for i in range(n)]


@pytest.fixture
def two_splits(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "train.jsonl", numbered(20))
    write_jsonl(tmp_path / "test.jsonl", numbered(10, "test"))
    return tmp_path


@pytest.fixture
def tokenizer():
    """A word-level tokenizer with a chat template that shows roles and the thinking switch."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "haiku": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<unk>")
    wrapped.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return wrapped


def indices(ds: DatasetConfig) -> list[str]:
    return [row["input"] for row in ds.load()]


# -- split slicing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("split", "expected"),
    [
        ("train", [f"train-{i}" for i in range(20)]),
        ("train[:3]", ["train-0", "train-1", "train-2"]),
        ("train[10:13]", ["train-10", "train-11", "train-12"]),
        ("train[-2:]", ["train-18", "train-19"]),
        ("train[:-18]", ["train-0", "train-1"]),
        ("train[18:100]", ["train-18", "train-19"]),  # clamped to the split's length
        ("train[5:2]", []),
        ("train[:10%]", ["train-0", "train-1"]),  # 10% of 20 rows = 2
        ("train[10%:20%]", ["train-2", "train-3"]),
        ("train[-10%:]", ["train-18", "train-19"]),
        ("test[:25%]", ["test-0", "test-1"]),  # round(2.5) = 2: round-half-even, as datasets
        ("test[:35%]", ["test-0", "test-1", "test-2", "test-3"]),  # round(3.5) = 4
        ("train[:2]+test[:1]", ["train-0", "train-1", "test-0"]),
        ("test[-1:] + train[1:2]", ["test-9", "train-1"]),
    ],
)
def test_split_slicing(two_splits: Path, split: str, expected: list[str]) -> None:
    assert indices(LocalDataset(path=two_splits, hf_split=split)) == expected


def test_bounds_are_the_ones_datasets_computes(tmp_path: Path) -> None:
    from datasets import ReadInstruction

    for n in (7, 10, 33, 101):
        write_jsonl(tmp_path / f"n{n}" / "train.jsonl", numbered(n))
        for spec in (
            "train[:15%]",
            "train[5%:45%]",
            "train[-33%:]",
            "train[:-50%]",
            "train[12%:13%]",
            "train[3:5]",
            "train[-4:-1]",
            "train[:1%]",
        ):
            (theirs,) = ReadInstruction.from_spec(spec).to_absolute({"train": n})
            expected = [f"train-{i}" for i in range(theirs.from_, theirs.to)]
            assert indices(LocalDataset(path=tmp_path / f"n{n}", hf_split=spec)) == expected


def test_unknown_split_lists_available_ones(two_splits: Path) -> None:
    with pytest.raises(
        DatasetError,
        match=r"unknown split 'validation'.*available splits: "
        r"test, train",
    ):
        LocalDataset(path=two_splits, hf_split="train[:2]+validation").load()


@pytest.mark.parametrize(
    "split",
    [
        "train[1:2",
        "train[::2]",
        "train[1:20%]",
        "train[:150%]",
        "",
        "train[a:b]",
        "train+",
        "train[:5](closest)",
    ],
)
def test_malformed_split_is_refused_at_construction(two_splits: Path, split: str) -> None:
    with pytest.raises(
        DatasetError,
        match=r"malformed split .*accepted forms: train, train\[:10\]"
        r"|malformed split .*percent",
    ):
        LocalDataset(path=two_splits, hf_split=split)


def test_pct1_dropremainder_rounding(tmp_path: Path) -> None:
    # 250 rows: 1% is trunc(2.5) = 2 rows, so 10% is 20 rows, not round(25.0) = 25.
    write_jsonl(tmp_path / "train.jsonl", numbered(250))
    write_jsonl(tmp_path / "test.jsonl", numbered(50, "test"))
    spec = "train[:10%](pct1_dropremainder)"
    assert len(LocalDataset(path=tmp_path, hf_split=spec).load()) == 20
    # Each term keeps its own rounding: 20 rows + round(0.1 * 50) = 5 rows.
    assert len(LocalDataset(path=tmp_path, hf_split=f"{spec}+test[:10%]").load()) == 25
    with pytest.raises(DatasetError, match=r"split 'test': .* 50 rows \(fewer than 100\)"):
        LocalDataset(path=tmp_path, hf_split="test[:10%](pct1_dropremainder)").load()


def test_split_names_may_carry_a_dash(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "validation-matched.jsonl", numbered(4, "vm"))
    ds = LocalDataset(path=tmp_path, hf_split="validation-matched[-1:]")
    assert indices(ds) == ["vm-3"]
    ds.hf_split = "validation-matched"
    assert len(ds.load()) == 4


# -- loading local files -----------------------------------------------------------------------

ROWS = [
    {"keywords": "autumn moon", "text": "a haiku", "n": 1},
    {"keywords": "frog, pond", "text": "another", "n": 2},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_one_file_of_each_format_is_the_train_split(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"rows{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, ROWS)
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".parquet":
        write_parquet(path, ROWS)
    else:
        write_csv(path, ROWS)
    ds = LocalDataset(path=str(path), input_column="keywords", hf_split="train[1:]")
    # Every format keeps the columns and their types (csv ints are inferred, as datasets does).
    assert ds.load() == [ROWS[1]]
    with pytest.raises(DatasetError, match="unknown split 'test'.*available splits: train"):
        LocalDataset(path=path, hf_split="test").load()


def test_json_file_may_be_column_oriented_or_json_lines(tmp_path: Path) -> None:
    columns = tmp_path / "columns.json"
    columns.write_text(json.dumps({"keywords": ["a", "b"], "n": [1, 2]}))
    assert LocalDataset(path=columns).load() == [
        {"keywords": "a", "n": 1},
        {"keywords": "b", "n": 2},
    ]
    lines = write_jsonl(tmp_path / "lines.json", ROWS)
    assert LocalDataset(path=lines).load() == ROWS


def test_folder_with_one_file_per_split_in_any_format(tmp_path: Path) -> None:
    write_parquet(tmp_path / "train.parquet", numbered(4))
    write_csv(tmp_path / "test.csv", numbered(3, "test"))
    (tmp_path / "README.md").write_text("not data")
    assert indices(LocalDataset(path=tmp_path, hf_split="test[1:]")) == ["test-1", "test-2"]
    assert indices(LocalDataset(path=tmp_path, hf_split="train[-1:]")) == ["train-3"]


def test_data_subfolder_with_parquet_shards_reads_shards_in_order(tmp_path: Path) -> None:
    rows = numbered(6)
    # Written out of order, so only sorting puts shard 0's rows first.
    write_parquet(tmp_path / "data" / "train-00001-of-00002.parquet", rows[3:])
    write_parquet(tmp_path / "data" / "train-00000-of-00002.parquet", rows[:3])
    write_parquet(tmp_path / "data" / "test-00000-of-00001.parquet", numbered(2, "test"))
    assert LocalDataset(path=tmp_path).load() == rows
    assert indices(LocalDataset(path=tmp_path, hf_split="train[2:4]+test")) == [
        "train-2",
        "train-3",
        "test-0",
        "test-1",
    ]


def test_subset_is_a_subfolder_of_a_local_dataset(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "easy" / "train.jsonl", numbered(2))
    write_jsonl(tmp_path / "hard" / "train.jsonl", numbered(5))
    assert len(LocalDataset(path=tmp_path, hf_subset="hard").load()) == 5
    with pytest.raises(DatasetError, match="subset 'medium' not found"):
        LocalDataset(path=tmp_path, hf_subset="medium").load()


def test_folder_without_data_files_and_mixed_formats_are_errors(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"no data files in .*<split>.jsonl"):
        LocalDataset(path=tmp_path).load()
    write_jsonl(tmp_path / "train.jsonl", numbered(1))
    write_parquet(tmp_path / "train.parquet", numbered(1))
    with pytest.raises(DatasetError, match="split 'train' has files of more than one format"):
        LocalDataset(path=tmp_path).load()


def test_bad_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"input": "ok"}\n\n{"input": broken}\n')
    with pytest.raises(DatasetError, match=r"train\.jsonl:3: not valid JSON"):
        LocalDataset(path=path).load()


@pytest.mark.parametrize(
    "repo", ["/nowhere/rows", "./rows", "~/no-such-palaestra-dir", "rows.jsonl"]
)
def test_missing_local_path_is_an_error_naming_it(repo: str) -> None:
    with pytest.raises(DatasetError, match=f"local dataset {repo} not found"):
        HuggingFaceDataset(hf_repo=repo).load()


def test_local_dataset_never_goes_to_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("hub called"))
    with pytest.raises(DatasetError, match="local dataset someone/rows not found"):
        LocalDataset(path="someone/rows").load()


def test_unset_hf_repo_says_to_set_it() -> None:
    with pytest.raises(DatasetError, match="HuggingFaceDataset.hf_repo is not set: set it"):
        HuggingFaceDataset().load()


def test_hub_id_goes_to_load_dataset_with_subset_and_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_list([{"question": "1+1", "answer": 2}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = HuggingFaceDataset(
        hf_repo="openai/gsm8k",
        hf_subset="main",
        hf_split="test[:1]",
        input_column="question",
        output_column="answer",
    )
    assert ds.load() == [{"question": "1+1", "answer": 2}]
    assert type(ds.load()[0]) is dict
    ds.load()  # cached: the hub is asked once
    assert calls == [("openai/gsm8k", "main", "test[:1]")]


def test_hub_value_error_says_which_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def fake_load_dataset(path, name=None, split=None):
        raise ValueError("Unknown split \"dev\". Should be one of ['train', 'test'].")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(DatasetError, match=r"openai/gsm8k \(subset None\) split 'dev'.*Unknown"):
        HuggingFaceDataset(hf_repo="openai/gsm8k", hf_split="dev").load()


def test_load_is_cached_until_a_field_changes(two_splits: Path) -> None:
    ds = LocalDataset(path=two_splits, hf_split="train[:2]")
    assert ds.load() is ds.load()
    ds.hf_split = "test[:1]"
    assert indices(ds) == ["test-0"]
    # A pickled config carries the settings, not the rows.
    assert pickle.loads(pickle.dumps(ds))._rows is None
    assert ds._rows is not None


# -- columns -----------------------------------------------------------------------------------


def test_missing_input_column_names_it_and_lists_columns(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    ds = LocalDataset(path=tmp_path, hf_split="train[:1]", input_column="keywordz")
    with pytest.raises(DatasetError) as err:
        ds.check_columns()
    assert str(err.value) == (
        f"column 'keywordz' (input_column) not found in {tmp_path} "
        "split 'train[:1]'; columns are: keywords, text, n"
    )


def test_missing_output_and_messages_columns(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(DatasetError, match=r"'label' \(output_column\) not found.*keywords, text"):
        LocalDataset(path=tmp_path, input_column="keywords", output_column="label").check_columns()
    with pytest.raises(DatasetError, match=r"'chat' \(messages_column\) not found"):
        LocalDataset(path=tmp_path, messages_column="chat").check_columns()
    # The messages column replaces the input column, so a missing 'input' is fine then.
    LocalDataset(path=tmp_path, messages_column="text").check_columns()


def test_column_missing_from_some_rows_and_empty_split(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", [{"input": "a"}, {"other": "b"}, {"other": "c"}])
    with pytest.raises(DatasetError, match=r"missing from row 1 .*\(2 of 3 rows lack it\)"):
        LocalDataset(path=tmp_path).check_columns()
    with pytest.raises(DatasetError, match=r"split 'train\[3:\]' is empty"):
        LocalDataset(path=tmp_path, hf_split="train[3:]").check_columns()


# -- prompts -----------------------------------------------------------------------------------


def test_prompt_template_formats_input_and_other_columns(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    ds = LocalDataset(
        path=tmp_path,
        input_column="keywords",
        output_column="text",
        prompt_template="Haiku #{n} about {input} ({keywords!r}).",
        apply_chat_template=False,
    )
    first, second = ds.prepare()
    assert first.text == "Haiku #1 about autumn moon ('autumn moon')."
    assert first.messages == [{"role": "user", "content": first.text}]
    assert (first.index, first.label, first.metadata) == (0, "a haiku", ROWS[0])
    assert (second.index, second.label) == (1, "another")


def test_prompt_template_naming_an_unknown_field(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    ds = LocalDataset(
        path=tmp_path,
        prompt_template="{input} in {season}",
        input_column="keywords",
        apply_chat_template=False,
    )
    with pytest.raises(DatasetError) as err:
        ds.prepare()
    assert "names {season}, which is neither 'input' nor a column" in str(err.value)
    assert "columns are: keywords, text, n" in str(err.value)
    with pytest.raises(DatasetError, match="positional field"):
        LocalDataset(path=tmp_path, prompt_template="about {}")
    with pytest.raises(DatasetError, match="not a valid format string"):
        LocalDataset(path=tmp_path, prompt_template="about {input")


def test_input_keyword_wins_over_a_column_called_input(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", [{"input": "column", "q": "question"}])
    ds = LocalDataset(path=tmp_path, input_column="q", apply_chat_template=False)
    assert ds.prepare()[0].text == "question"


def test_system_prompt_without_chat_template(two_splits: Path) -> None:
    ds = LocalDataset(
        path=two_splits, hf_split="train[:1]", system_prompt="Be brief.", apply_chat_template=False
    )
    (prompt,) = ds.prepare()
    assert prompt.text == "Be brief.\n\ntrain-0"
    assert prompt.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "train-0"},
    ]


def test_chat_template_renders_messages(two_splits: Path, tokenizer) -> None:
    ds = LocalDataset(
        path=two_splits,
        hf_split="train[:1]",
        system_prompt="Be brief.",
        prompt_template="Write about {input}.",
    )
    (prompt,) = ds.prepare(tokenizer)
    assert prompt.text == "<|system|>Be brief.\n<|user|>Write about train-0.\n<|assistant|>"


def test_chat_template_kwargs_reach_the_template(two_splits: Path, tokenizer) -> None:
    ds = LocalDataset(path=two_splits, hf_split="train[:1]")
    assert ds.prepare(tokenizer, {"enable_thinking": False})[0].text == (
        "<|user|>train-0\n<nothink><|assistant|>"
    )
    assert "<nothink>" not in ds.prepare(tokenizer, {"enable_thinking": True})[0].text


def test_chat_template_needs_a_tokenizer_with_a_template(two_splits: Path, tokenizer) -> None:
    ds = LocalDataset(path=two_splits)
    with pytest.raises(DatasetError, match="needs a tokenizer because apply_chat_template"):
        ds.prepare()
    tokenizer.chat_template = None
    with pytest.raises(DatasetError, match="the tokenizer has no chat template"):
        ds.prepare(tokenizer)


def test_messages_column_is_used_as_the_conversation(tmp_path: Path, tokenizer) -> None:
    chat = [{"role": "user", "content": "hello"}]
    with_system = [{"role": "system", "content": "Own."}, {"role": "user", "content": "hi"}]
    write_jsonl(
        tmp_path / "train.jsonl", [{"chat": chat, "gold": 1}, {"chat": with_system, "gold": 2}]
    )
    ds = LocalDataset(
        path=tmp_path, messages_column="chat", output_column="gold", system_prompt="Default."
    )
    first, second = ds.prepare(tokenizer)
    assert first.text == "<|system|>Default.\n<|user|>hello\n<|assistant|>"
    assert second.messages == with_system  # the row's own system message wins
    assert (first.label, second.label) == (1, 2)
    write_jsonl(tmp_path / "train.jsonl", [{"chat": "not messages"}])
    with pytest.raises(DatasetError, match="row 0 of .*must hold a list of"):
        LocalDataset(path=tmp_path, messages_column="chat").prepare(tokenizer)


# -- the prepared-prompts cache ----------------------------------------------------------------


def test_prepared_file_is_written_and_reused_only_when_asked(
    two_splits: Path, tokenizer, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    ds = LocalDataset(
        path=two_splits, hf_split="train[:2]", output_column="i", always_prepare=False
    )
    prompts = ds.prepare(tokenizer, cache_dir=cache)
    (path,) = cache.iterdir()  # no temp files are left behind
    assert path.name.startswith("prepared-") and path.suffix == ".jsonl"
    assert len(path.stem.removeprefix("prepared-")) == 16
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[1] == {
        "index": 1,
        "text": "<|user|>train-1\n<|assistant|>",
        "messages": [{"role": "user", "content": "train-1"}],
        "label": 1,
        "metadata": {"input": "train-1", "i": 1},
    }

    # Tamper with the file: always_prepare=False must serve it as it is ...
    records[0]["text"] = "from the cache"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert ds.prepare(tokenizer, cache_dir=cache)[0].text == "from the cache"
    # ... and always_prepare=True must rewrite the same file from the rows.
    fresh = LocalDataset(path=two_splits, hf_split="train[:2]", output_column="i")
    assert fresh.prepare(tokenizer, cache_dir=cache) == prompts
    assert [p.name for p in cache.iterdir()] == [path.name]
    assert json.loads(path.read_text().splitlines()[0])["text"] == "<|user|>train-0\n<|assistant|>"


def test_prepared_file_name_tracks_what_shapes_the_prompts(
    two_splits: Path, tokenizer, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    base = LocalDataset(path=two_splits, hf_split="train[:1]")
    base.prepare(tokenizer, cache_dir=cache)
    LocalDataset(path=two_splits, hf_split="train[:1]", always_prepare=False).prepare(
        tokenizer, cache_dir=cache
    )  # always_prepare says when to write, not what: same file
    assert len(list(cache.iterdir())) == 1
    LocalDataset(path=two_splits, hf_split="train[:2]").prepare(tokenizer, cache_dir=cache)
    base.prepare(tokenizer, {"enable_thinking": False}, cache_dir=cache)
    tokenizer.chat_template = "{{ messages[0].content }}"
    base.prepare(tokenizer, cache_dir=cache)
    write_jsonl(two_splits / "train.jsonl", numbered(21))  # an edited source file
    base.prepare(tokenizer, cache_dir=cache)
    assert len(list(cache.iterdir())) == 5  # each change above made a new file


def test_parquet_prepared_file_round_trips(tmp_path: Path) -> None:
    rows = [{"input": "a", "label": 1}, {"input": "b", "label": "two"}]  # label changes type
    write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    ds = LocalDataset(
        path=tmp_path,
        output_column="label",
        output_format="parquet",
        apply_chat_template=False,
        always_prepare=False,
    )
    prompts = ds.prepare(cache_dir=tmp_path / "cache")
    (path,) = (tmp_path / "cache").iterdir()
    assert path.suffix == ".parquet"
    assert pq.read_table(path).column("text").to_pylist() == ["a", "b"]
    assert ds.prepare(cache_dir=tmp_path / "cache") == prompts
    assert [p.label for p in prompts] == [1, "two"]


# -- the config class --------------------------------------------------------------------------


def test_unknown_keyword_names_it_and_suggests_the_field() -> None:
    with pytest.raises(TypeError) as err:
        HuggingFaceDataset(hf_splt="train[:10]")
    message = str(err.value)
    assert "unexpected keyword 'hf_splt'; did you mean 'hf_split'?" in message
    assert "Known fields: hf_repo, hf_subset, hf_split, input_column" in message


def test_unknown_subclass_attribute_is_an_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"Typo\.input_colum is not a field.*'input_column'"):

        class Typo(HuggingFaceDataset):
            input_colum = "keywords"

    class Fine(HuggingFaceDataset):  # methods, properties and private names are not fields
        input_column = "q"
        _note = "private"

        def load(self):
            return [{"q": "x"}]

        @property
        def size(self) -> int:
            return 1

    assert Fine().load() == [{"q": "x"}]


def test_assigning_an_unknown_attribute_or_a_wrong_type_is_refused(two_splits: Path) -> None:
    ds = LocalDataset(path=two_splits)
    with pytest.raises(AttributeError, match="no field 'input_colum'; did you mean"):
        ds.input_colum = "x"
    with pytest.raises(TypeError, match="apply_chat_template must be bool, got 'no'"):
        LocalDataset(path=two_splits, apply_chat_template="no")
    with pytest.raises(DatasetError, match="output_format is 'csv'; allowed: jsonl, parquet"):
        LocalDataset(path=two_splits, output_format="csv")


def test_bad_class_level_value_is_caught_at_construction() -> None:
    class Bad(HuggingFaceDataset):
        output_format = "arrow"

    with pytest.raises(DatasetError, match="Bad.output_format is 'arrow'"):
        Bad()


def test_subclass_fields_keep_their_docs_and_read_as_class_attributes() -> None:
    class Topics(LocalDataset):
        path = "topics.jsonl"
        input_column = "topic"
        difficulty: str = "easy"  # an annotated attribute declares a new field

    doc = Topics.model_fields["input_column"].description
    assert doc == HuggingFaceDataset.model_fields["input_column"].description
    assert doc.startswith("Column whose value fills")
    assert (Topics.input_column, Topics.hf_split, Topics.difficulty) == ("topic", "train", "easy")
    ds = Topics(difficulty="hard")
    assert (ds.hf_repo, ds.difficulty) == ("topics.jsonl", "hard")
    assert ds.to_dict()["difficulty"] == "hard"
    with pytest.raises(TypeError, match="Topics.difficulty must be str, got 3"):
        Topics(difficulty=3)


def test_local_dataset_path_alias(two_splits: Path) -> None:
    ds = LocalDataset(path=two_splits / "test.jsonl", input_column="i")
    assert ds.hf_repo == ds.path == str(two_splits / "test.jsonl")
    assert LocalDataset(hf_repo=str(two_splits)).path == str(two_splits)
    with pytest.raises(TypeError, match="same field, set one"):
        LocalDataset(path="a.jsonl", hf_repo="b.jsonl")


class _Haiku(HuggingFaceDataset):
    input_column = "keywords"
    output_column = "text"
    prompt_template = "Write a haiku about {input}."


def test_to_dict_is_json_and_rebuilds_the_config(tmp_path: Path) -> None:
    ds = _Haiku(hf_repo=tmp_path, hf_split="train[:3]")  # a Path is stored as str
    data = json.loads(json.dumps(ds.to_dict()))
    assert data["class"] == f"{__name__}._Haiku"
    assert data["hf_repo"] == str(tmp_path) and data["input_column"] == "keywords"
    assert set(data) == {"class", *DatasetConfig.model_fields}
    rebuilt = _Haiku(**{k: v for k, v in data.items() if k != "class"})
    assert rebuilt.to_dict() == ds.to_dict()
    assert repr(ds) == f"_Haiku(hf_repo={str(tmp_path)!r}, hf_split='train[:3]')"


def test_user_snippet_pattern(tmp_path: Path) -> None:
    write_jsonl(
        tmp_path / "train.jsonl", [{"keywords": f"word{i}", "text": f"poem {i}"} for i in range(20)]
    )

    class HaikuDataset(HuggingFaceDataset):
        hf_repo = str(tmp_path)
        input_column = "keywords"
        output_column = "text"
        output_format = "jsonl"
        apply_chat_template = True
        always_prepare = True
        prompt_template = "Write a haiku about {input}."

    train_dataset = HaikuDataset(hf_split="train[:10]")
    eval_dataset = HaikuDataset(hf_split="train[10:15]")
    rows = eval_dataset.load()
    assert rows == [{"keywords": f"word{i}", "text": f"poem {i}"} for i in range(10, 15)]
    assert len(train_dataset.load()) == 10
    assert eval_dataset.input_column == "keywords"
    assert eval_dataset.prompt_template == "Write a haiku about {input}."
    assert HaikuDataset.output_column == "text"


# -- built-in datasets -------------------------------------------------------------------------


def test_unknown_builtin_dataset_lists_the_names() -> None:
    with pytest.raises(ValueError, match="unknown built-in dataset 'limericks'; available: "):
        builtin_dataset("limericks")


def test_builtin_haiku_has_a_train_split_of_keywords_and_text() -> None:
    path = builtin_dataset("haiku")
    assert isinstance(path, Path) and path.is_dir()

    class HaikuDataset(HuggingFaceDataset):
        hf_repo = str(builtin_dataset("haiku"))
        input_column = "keywords"
        output_column = "text"
        prompt_template = "Write a haiku about {input}."

    rows = HaikuDataset().load()
    assert len(rows) >= 300
    HaikuDataset().check_columns()
    assert len(HaikuDataset(hf_split="train[10:15]").load()) == 5
