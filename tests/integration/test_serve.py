"""The endpoint: a real server process on loopback, driven with the official openai client."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from palaestra import EvalConfig, LocalDataset, ModelConfig
from palaestra.serve import Endpoint, EndpointError

MESSAGES = [{"role": "user", "content": "Write a haiku about rain."}]


@pytest.fixture(scope="module")
def module_home(tmp_path_factory):
    old = os.environ.get("PALAESTRA_HOME")
    home = tmp_path_factory.mktemp("serve-home")
    os.environ["PALAESTRA_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("PALAESTRA_HOME", None)
    else:
        os.environ["PALAESTRA_HOME"] = old


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> ModelConfig:
    return ModelConfig(name="tiny", source=str(tiny_model_dir))


@pytest.fixture(scope="module")
def endpoint(module_home, tiny):
    served = Endpoint.launch(tiny, name="tiny-open", recreate_if_existing=True)
    served.wait_until_ready(timeout=120)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{endpoint.url}/v1", api_key="unused", max_retries=0)


def health(endpoint) -> dict:
    return httpx.get(f"{endpoint.url}/health").json()


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny-open"]


def test_chat_completion_reports_usage_and_finish_reason(client, endpoint, tiny_model_dir):
    from transformers import AutoTokenizer

    reply = client.chat.completions.create(
        model="tiny-open", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=3
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in {"stop", "length"}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False).input_ids)
    assert 1 <= reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == 12


def test_a_seed_repeats_and_max_tokens_bounds(client):
    def ask(seed):
        return client.chat.completions.create(
            model="tiny-open", messages=MESSAGES, max_tokens=20, seed=seed
        )

    first, again, other = ask(11), ask(11), ask(12)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.usage.completion_tokens <= 20
    # The tiny model's distribution is near uniform over 96 characters: seeds differ.
    assert first.choices[0].message.content != other.choices[0].message.content


def test_streamed_chat_equals_the_whole_reply(client):
    whole = client.chat.completions.create(
        model="tiny-open", messages=MESSAGES, max_tokens=16, temperature=0
    )
    stream = client.chat.completions.create(
        model="tiny-open",
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_streaming_sends_tokens_as_they_are_sampled(client):
    # Every token of the character-level tiny model is one character: each arrives on its own.
    kwargs = {"model": "tiny-open", "messages": MESSAGES, "max_tokens": 40, "seed": 4}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    deltas = [
        c.choices[0].delta.content
        for c in client.chat.completions.create(**kwargs, stream=True)
        if c.choices and c.choices[0].delta.content
    ]
    assert "".join(deltas) == whole
    assert len(deltas) >= len(whole.strip()) - 2


def test_streams_of_several_choices_and_a_stop_string(client):
    kwargs = {"model": "tiny-open", "prompt": "abc", "max_tokens": 30, "n": 2, "seed": 9}
    whole = [c.text for c in client.completions.create(**kwargs).choices]
    stop = whole[0][5] if len(whole[0]) > 5 else "\n"
    cut = [c.text for c in client.completions.create(**kwargs, stop=[stop]).choices]
    texts = ["", ""]
    finish = [None, None]
    for chunk in client.completions.create(**kwargs, stop=[stop], stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == cut
    assert cut[0] == whole[0][: whole[0].index(stop)]
    assert finish[0] == "stop"


def test_n_gives_distinct_indexed_choices(client):
    reply = client.chat.completions.create(
        model="tiny-open", messages=MESSAGES, max_tokens=16, n=2, seed=5
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content != reply.choices[1].message.content


def test_stop_strings_end_the_text(client):
    # Greedy text of the tiny model, then ask it to stop at a character from its middle.
    whole = (
        client.completions.create(model="tiny-open", prompt="abc", max_tokens=30, temperature=0)
        .choices[0]
        .text
    )
    assert len(whole) >= 4
    stop = whole[3]
    cut = client.completions.create(
        model="tiny-open", prompt="abc", max_tokens=30, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.text == whole[: whole.index(stop)]
    assert cut.finish_reason == "stop"


def test_text_completions_take_a_list_of_prompts(client):
    reply = client.completions.create(
        model="tiny-open", prompt=["one", "two"], max_tokens=5, n=2, seed=1
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert all(len(c.text) <= 5 for c in reply.choices)  # one character per token


def test_concurrent_requests_share_generation_passes(client, endpoint):
    before = health(endpoint)
    with ThreadPoolExecutor(8) as pool:
        replies = list(
            pool.map(
                lambda s: client.chat.completions.create(
                    model="tiny-open", messages=MESSAGES, max_tokens=8, seed=s
                ),
                range(8),
            )
        )
    after = health(endpoint)
    assert len(replies) == 8
    assert after["rows"] - before["rows"] == 8
    # One at a time would take a pass per token; sharing passes takes about one per token of
    # the longest reply, plus a few while the requests arrive.
    tokens = sum(reply.usage.completion_tokens for reply in replies)
    assert after["passes"] - before["passes"] <= tokens / 2, tokens
    # The same prompt eight times: a request that joins another (in the same pass, or while
    # it generates) copies the whole 16-token chunks of the prompt from its slot.
    chunks = (replies[0].usage.prompt_tokens - 1) // 16 * 16
    copied = after["prefix_tokens"] - before["prefix_tokens"]
    assert chunks > 0 and copied % chunks == 0 and chunks <= copied <= 7 * chunks, copied


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ("{not json", 400, None),
        ({"model": "tiny-open"}, 400, "messages"),
        ({"model": "tiny-open", "messages": []}, 400, "messages"),
        ({"model": "nope", "messages": MESSAGES}, 404, "model"),
        ({"model": "tiny-open", "messages": MESSAGES, "max_tokens": 100_000}, 400, "max_tokens"),
        ({"model": "tiny-open", "messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
        ({"model": "tiny-open", "messages": MESSAGES, "n": "2"}, 400, "n"),
        ({"model": "tiny-open", "messages": [{"role": "user"}], "max_tokens": 4}, 200, None),
        (
            {"model": "tiny-open", "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages.0.role",
        ),
    ],
)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(
    endpoint, client, body, status, param
):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(
        f"{endpoint.url}/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert error["message"]
        assert error["param"] == param
        assert error["type"] in {"invalid_request_error", "not_found_error"}
    ok = client.chat.completions.create(model="tiny-open", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason in {"stop", "length"}


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="tiny-open", messages=MESSAGES, max_tokens=10**6)


def test_an_authenticated_endpoint_refuses_a_missing_key(module_home, tiny):
    locked = Endpoint.launch(tiny, name="tiny-locked", unauthenticated=False)
    try:
        locked.wait_until_ready(timeout=120)
        assert locked.api_key and locked.info["authenticated"]
        assert oct((module_home / "endpoints" / "tiny-locked.key").stat().st_mode)[-3:] == "600"
        anonymous = openai.OpenAI(base_url=f"{locked.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.chat.completions.create(model="tiny-locked", messages=MESSAGES)
        assert httpx.get(f"{locked.url}/v1/models").status_code == 401
        keyed = openai.OpenAI(base_url=f"{locked.url}/v1", api_key=locked.api_key)
        assert keyed.models.list().data[0].id == "tiny-locked"
        # A handle found by name knows the key too.
        assert Endpoint.get("tiny-locked").chat(MESSAGES, max_tokens=3)["role"] == "assistant"
    finally:
        locked.stop()


def test_launch_reuses_or_recreates_by_name(endpoint, tiny):
    same = Endpoint.launch(tiny, name="tiny-open")
    assert same.info["pid"] == endpoint.info["pid"]
    assert Endpoint.get("tiny-open").url == endpoint.url
    assert "tiny-open" in [e.name for e in Endpoint.list()]


def test_stop_ends_the_process_and_the_record(module_home, tiny):
    temporary = Endpoint.launch(tiny, name="tiny-temp", recreate_if_existing=True)
    temporary.wait_until_ready(timeout=120)
    replaced = Endpoint.launch(tiny, name="tiny-temp", recreate_if_existing=True)
    assert replaced.info["pid"] != temporary.info["pid"]
    assert not temporary.is_running
    replaced.stop()
    assert not replaced.is_running
    with pytest.raises(KeyError, match="tiny-temp"):
        Endpoint.get("tiny-temp")
    assert not (module_home / "endpoints" / "tiny-temp.json").exists()


def test_a_requests_missing_length_and_temperature_come_from_the_model(module_home, tiny):
    preset = tiny.model_copy(update={"default_max_tokens": 5, "default_temperature": 0.0})
    served = Endpoint.launch(preset, name="tiny-preset", recreate_if_existing=True)
    try:
        served.wait_until_ready(timeout=120)
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)

        def ask(**fields):
            return client.chat.completions.create(model="tiny-preset", messages=MESSAGES, **fields)

        # Left out: 5 tokens, greedy (the near-uniform tiny model would differ by seed else).
        first, second = ask(seed=1), ask(seed=2)
        assert first.usage.completion_tokens == 5
        assert first.choices[0].finish_reason == "length"
        assert first.choices[0].message.content == second.choices[0].message.content
        # Given: the request's own values win.
        assert ask(max_tokens=9).usage.completion_tokens == 9
        hot = [ask(temperature=1.0, seed=s).choices[0].message.content for s in (1, 2)]
        assert hot[0] != hot[1]
    finally:
        served.stop()


def test_a_server_that_cannot_load_says_why(module_home, tmp_path, tiny_model_dir):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(
        json.dumps({**config, "model_type": "no-such-architecture"})
    )
    endpoint = Endpoint.launch(ModelConfig(name="broken", source=str(broken)))
    with pytest.raises(EndpointError, match="no-such-architecture"):
        endpoint.wait_until_ready(timeout=120)


def test_evaluate_scores_every_row_and_saves_the_result(endpoint, prompts_file, module_home):
    dataset = LocalDataset(
        path=str(prompts_file), input_column="topic", prompt_template="Write a haiku about {input}."
    )
    result = EvalConfig(
        dataset,
        eval_fn=lambda text: float(len(text)),
        generate_kwargs={"max_tokens": 10, "seed": 0},
    ).evaluate(endpoint, max_concurrency=3, show_progress=False)
    assert result.total == 6
    assert [r["score"] for r in result.rows] == [float(len(r["response"])) for r in result.rows]
    assert result.mean == pytest.approx(sum(len(r["response"]) for r in result.rows) / 6)
    assert result.rows[2]["prompt"] == "Write a haiku about sun."
    saved = json.loads(result.path.read_text())
    assert saved["mean"] == pytest.approx(result.mean)
    assert saved["endpoint"] == "tiny-open" and saved["model"] == "tiny"
    assert [r["response"] for r in saved["rows"]] == [r["response"] for r in result.rows]
    assert result.path.parent == module_home / "evals"


def test_eval_response_fn_sees_the_row(endpoint, prompts_file):
    dataset = LocalDataset(path=str(prompts_file), input_column="topic", output_column="answer")
    seen = []
    lock = threading.Lock()

    async def compare(message, row):
        with lock:
            seen.append(row["answer"])
        return 1.0 if message["content"] == row["answer"] else 0.0

    result = EvalConfig(
        dataset, eval_response_fn=compare, generate_kwargs={"max_tokens": 3}
    ).evaluate(endpoint, show_progress=False)
    assert sorted(seen) == sorted(["RAIN", "SNOW", "SUN", "WIND", "MOON", "SEA"])
    assert result.mean == 0.0


def test_the_tutorials_hand_written_eval_loop_works(endpoint, prompts_file):
    dataset = LocalDataset(
        path=str(prompts_file), input_column="topic", prompt_template="Write a haiku about {input}."
    )

    def run_eval(deployment, max_concurrency: int = 2) -> float:
        deployment.wait_until_ready(timeout=15 * 60)

        def score_one(example):
            prompt = dataset.prompt_template.format(input=str(example[dataset.input_column]))
            msg = deployment.chat(
                [{"role": "user", "content": prompt}],
                chat_template_kwargs={"enable_thinking": False},
                max_tokens=8,
            )
            return float(len(msg.get("content") or msg.get("reasoning_content") or ""))

        with ThreadPoolExecutor(max_workers=max_concurrency) as executor:
            scores = list(executor.map(score_one, dataset.load()))
        return sum(scores) / len(scores)

    assert 0 <= run_eval(endpoint) <= 8


def test_chat_errors_name_the_status(endpoint):
    with pytest.raises(EndpointError, match="400") as caught:
        endpoint.chat(MESSAGES, max_tokens=10**6)
    assert caught.value.status == 400


def test_cli_serves_lists_evaluates_and_stops(module_home, tiny_model_dir):
    import signal
    import subprocess
    import sys
    import time

    from palaestra.cli import main

    command = [
        sys.executable,
        "-m",
        "palaestra.cli",
        "serve",
        str(tiny_model_dir),
        "--port",
        "0",
        "--name",
        "tiny-cli",
    ]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                found = Endpoint.get("tiny-cli")
                found.wait_until_ready(timeout=120)
                break
            except KeyError:
                assert server.poll() is None, server.stdout.read()
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert found.info["pid"] == server.pid
        assert main(["endpoint", "list"]) == 0
        assert (
            main(
                [
                    "eval",
                    "tiny-cli",
                    "--dataset",
                    "builtin:haiku",
                    "--split",
                    "test[:5]",
                    "--input-column",
                    "keywords",
                    "--prompt-template",
                    "Write a haiku about {input}.",
                    "--score",
                    "palaestra.rewards.haiku:score_haiku",
                    "--max-tokens",
                    "6",
                    "--json",
                ]
            )
            == 0
        )
        saved = sorted((module_home / "evals").glob("*.json"))[-1]
        result = json.loads(saved.read_text())
        # Six characters cannot hold three lines: the tutorial's score gives -10 to each.
        assert result["total"] == 5 and result["mean"] == -10.0
        assert result["endpoint"] == "tiny-cli"
    finally:
        server.send_signal(signal.SIGINT)
        output, _ = server.communicate(timeout=60)
    assert "serving tiny-cli at http://127.0.0.1:" in output
    assert not (module_home / "endpoints" / "tiny-cli.json").exists()


def test_a_lora_checkpoint_serves_merged(module_home, tiny, tiny_model_dir, prompts_file):
    pytest.importorskip("peft")
    from palaestra.train.lora import export_merged
    from tests.support.tiny_runs import make_config

    result = make_config(tiny_model_dir, prompts_file, num_rollout=1, lora_rank=4, lr=1e-1).train()
    checkpoint = result.checkpoints()[-1]
    merged = export_merged(checkpoint, module_home / "merged")
    adapters = Endpoint.launch(tiny, checkpoint, name="tiny-lora")
    plain = Endpoint.launch(ModelConfig(name="merged", source=str(merged)), name="tiny-merged")
    try:
        ask = {"max_tokens": 12, "temperature": 0}
        served = adapters.wait_until_ready(120).chat(MESSAGES, **ask)["content"]
        assert served == plain.wait_until_ready(120).chat(MESSAGES, **ask)["content"]
        assert adapters.info["step"] == 1 and adapters.info["run_id"] == checkpoint.run_id
    finally:
        adapters.stop()
        plain.stop()


def test_several_samples_per_prompt_score_their_mean(endpoint, prompts_file):
    dataset = LocalDataset(path=str(prompts_file), input_column="topic")
    result = EvalConfig(
        dataset,
        eval_fn=lambda text: float(len(text)),
        n_samples_per_prompt=3,
        generate_kwargs={"max_tokens": 10, "seed": 1},
    ).evaluate(endpoint, show_progress=False)
    for row in result.rows:
        assert len(row["responses"]) == 3 and len(set(row["responses"])) > 1
        assert row["scores"] == [float(len(r)) for r in row["responses"]]
        assert row["score"] == pytest.approx(sum(row["scores"]) / 3)
    assert result.mean == pytest.approx(sum(sum(r["scores"]) for r in result.rows) / 18)
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        EvalConfig(dataset, eval_fn=len, generate_kwargs={"n": 2})


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def sampling_in(request, module_home, tiny):
    """An endpoint of the tiny model sampling in each precision it can sample in (bfloat16
    is emulated, and slow, on CPUs without AVX-512 BF16: the tiny model keeps it short)."""
    name = f"tiny-{request.param}"
    served = Endpoint.launch(tiny, name=name, recreate_if_existing=True, precision=request.param)
    served.wait_until_ready(timeout=120)
    yield openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0), name
    served.stop()


def test_a_seeded_request_gets_the_same_reply_alone_and_among_others(sampling_in):
    client, name = sampling_in

    def ask(seed: int, text: str = "Write a haiku about rain.") -> str:
        reply = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": text}],
            max_tokens=24,
            temperature=1.0,
            seed=seed,
        )
        return reply.choices[0].message.content

    by_itself = ask(5)
    with ThreadPoolExecutor(8) as pool:
        crowd = [pool.submit(ask, s, "Write a haiku about snow." * (s % 3 + 1)) for s in range(7)]
        among_others = pool.submit(ask, 5)
        crowd = [future.result() for future in crowd]
    assert among_others.result() == by_itself
    assert len(set(crowd)) > 1  # the others really were other requests


def test_an_endpoint_refuses_a_precision_it_does_not_know(tiny):
    with pytest.raises(ValueError, match="precision must be auto, float32 or bfloat16"):
        Endpoint.launch(tiny, name="tiny-fp16", precision="float16")


def test_an_evaluation_repeats_exactly_whatever_its_concurrency(endpoint, prompts_file):
    dataset = LocalDataset(
        path=str(prompts_file), input_column="topic", prompt_template="Write a haiku about {input}."
    )
    config = EvalConfig(
        dataset, eval_fn=lambda text: float(len(text)), generate_kwargs={"max_tokens": 12}
    )
    one = config.evaluate(endpoint, max_concurrency=1, show_progress=False)
    six = config.evaluate(endpoint, max_concurrency=6, show_progress=False)
    assert [r["response"] for r in six.rows] == [r["response"] for r in one.rows]
    assert six.mean == one.mean
    assert json.loads(six.path.read_text())["seed"] == 0
    other = EvalConfig(
        dataset, eval_fn=lambda text: float(len(text)), generate_kwargs={"max_tokens": 12}, seed=1
    ).evaluate(endpoint, max_concurrency=6, show_progress=False)
    assert [r["response"] for r in other.rows] != [r["response"] for r in one.rows]
