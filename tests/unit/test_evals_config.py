"""EvalConfig: its checks, and evaluate() against a scripted endpoint (no server, no model)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from palaestra import EvalConfig, LocalDataset


class ScriptedEndpoint:
    """Answers every request with the prompt upper-cased, once per requested sample."""

    name = "scripted"
    info = {"model": "echo", "checkpoint": None, "run_id": None, "step": None}

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def wait_until_ready(self) -> None:
        pass

    def chat_completion(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        with self._lock:
            self.requests.append({"messages": messages, **kwargs})
        text = messages[-1]["content"].upper()
        n = kwargs.get("n", 1)
        return {"choices": [{"message": {"content": f"{text}{'!' * i}"}} for i in range(n)]}

    def completion(self, prompt: str, **kwargs: Any) -> dict[str, Any]:
        with self._lock:
            self.requests.append({"prompt": prompt, **kwargs})
        return {"choices": [{"text": prompt.upper()}]}


@pytest.fixture
def dataset(tmp_path: Path) -> LocalDataset:
    rows = [{"topic": t, "answer": t.upper()} for t in ("rain", "snow", "sun")]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return LocalDataset(path=str(path), input_column="topic", output_column="answer")


def test_dataset_by_position_or_keyword(dataset: LocalDataset) -> None:
    kwargs = {"max_tokens": 4}
    config = EvalConfig(dataset, eval_fn=len, generate_kwargs=kwargs, name="smoke")
    assert config.dataset is dataset and config.generate_kwargs == kwargs
    assert config.generate_kwargs is not kwargs  # a later change to the caller's dict is not ours
    assert EvalConfig(dataset=dataset, eval_fn=len).generate_kwargs == {}
    assert EvalConfig(dataset, eval_fn=len, generate_kwargs=None).generate_kwargs == {}
    assert "batched pass" in EvalConfig.model_fields["n_samples_per_prompt"].description


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one of eval_fn or eval_response_fn"),
        ({"eval_fn": len, "eval_response_fn": len}, "exactly one of eval_fn or eval_response_fn"),
        ({"eval_fn": len, "n_samples_per_prompt": 0}, "must be at least 1, got 0"),
        ({"eval_fn": len, "generate_kwargs": {"n": 2}}, r"rather than generate_kwargs\['n'\]"),
        ({"eval_fn": len, "n_sample_per_prompt": 2}, "n_sample_per_prompt"),
        ({"eval_fn": "not callable"}, "eval_fn"),
    ],
)
def test_bad_fields_are_errors_naming_them(dataset, fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        EvalConfig(dataset, **fields)


def test_dataset_must_be_a_dataset_config() -> None:
    with pytest.raises(ValueError, match="dataset"):
        EvalConfig("rows.jsonl", eval_fn=len)


def test_evaluate_scores_rows_and_saves_the_result(dataset, home: Path) -> None:
    endpoint = ScriptedEndpoint()
    result = EvalConfig(
        dataset,
        eval_response_fn=lambda message, row: float(message["content"] == row["answer"]),
        generate_kwargs={"max_tokens": 4},
    ).evaluate(endpoint, max_concurrency=2, show_progress=False)
    # The endpoint gets messages (it applies its own chat template) and the generate kwargs.
    assert sorted(r["messages"][-1]["content"] for r in endpoint.requests) == [
        "rain",
        "snow",
        "sun",
    ]
    assert all(r["max_tokens"] == 4 and "n" not in r for r in endpoint.requests)
    assert (result.mean, result.total) == (1.0, 3)
    assert dataset.apply_chat_template is True  # evaluate() changed a copy, not the config
    saved = json.loads(result.path.read_text())
    assert result.path.parent == home / "evals"
    assert (saved["mean"], saved["endpoint"], saved["model"]) == (1.0, "scripted", "echo")


def test_samples_per_prompt_go_out_as_n_and_score_their_mean(dataset, home: Path) -> None:
    endpoint = ScriptedEndpoint()
    result = EvalConfig(dataset, eval_fn=len, n_samples_per_prompt=3).evaluate(
        endpoint, show_progress=False
    )
    assert all(r["n"] == 3 for r in endpoint.requests)
    rain = result.rows[0]
    assert rain["responses"] == ["RAIN", "RAIN!", "RAIN!!"]
    assert rain["scores"] == [4.0, 5.0, 6.0] and rain["score"] == 5.0  # (4 + 5 + 6) / 3
