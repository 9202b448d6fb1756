"""Multi-turn rollouts on the character tokenizer: the tokens and mask of an episode worked out
by hand, tools, ids kept as sampled, errors that name the episode, truncation, one batched
engine call per turn, custom generate functions, and evaluation through an endpoint (a fake)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch

from palaestra import EvalConfig, LocalDataset, Recipe
from palaestra.engine import SamplingParams
from palaestra.engine.torch_engine import TorchEngine
from palaestra.rollout.episode import EpisodeError
from palaestra.rollout.multi_turn import MultiTurnRollout
from palaestra.rollout.tools import ToolError
from palaestra.train.batch import build_train_batch
from palaestra.train.records import sample_row
from palaestra.types import Completion, Prompt, Step
from tests.support.tiny_models import build_tiny_model, build_tokenizer

END = "<|im_end|>"
START = "<|im_start|>"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def ids(tokenizer, *parts: str) -> list[int]:
    """Token ids written out by hand: a special token is one part, text is one id per char."""
    out = []
    for part in parts:
        tokens = [part] if part in (END, START) else list(part)
        out += tokenizer.convert_tokens_to_ids(tokens)
    return out


class ScriptedEngine:
    """Answers reply k of each episode (k = replies already in its context) with
    ``replies[k]`` and the end token; log-probs -0.1, -0.2, ... per token. Records each call's
    rows."""

    weight_version = 0

    def __init__(self, tokenizer, replies: list[str], end: bool = True) -> None:
        self.tokenizer = tokenizer
        self.replies = replies
        self.end = end
        self.calls: list[list[int]] = []

    def generate_requests(self, requests):
        self.calls.append([r.n for r in requests])
        out = []
        for request in requests:
            context = self.tokenizer.decode(request.token_ids, skip_special_tokens=False)
            k = context.count(f"{START}assistant") - 1
            text = self.replies[min(k, len(self.replies) - 1)]
            tokens = ids(self.tokenizer, text) + ([self.tokenizer.eos_token_id] if self.end else [])
            logprobs = [-0.1 * (i + 1) for i in range(len(tokens))]
            out.append([Completion(tokens, text, "stop", logprobs)] * request.n)
        return out

    def update_weights(self, weights, version: int) -> None: ...

    def close(self) -> None: ...


class CountingEngine:
    """A real engine, its calls counted with the rows each sampled."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.rows_per_call: list[int] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate_requests(self, requests):
        self.rows_per_call.append(sum(r.n for r in requests))
        return self.engine.generate_requests(requests)


class ThreeGuesses:
    """Says "no" to the first two replies; the third ends the episode with reward 1."""

    def start(self, row):
        self.replies = 0
        return f"Guess {row['topic']}"

    def step(self, reply):
        self.replies += 1
        if self.replies == 3:
            return Step(reward=1.0, done=True, metadata={"last": reply})
        return Step("no", reward=0.25)


class Endless:
    def start(self, row):
        return "Go"

    def step(self, reply):
        return Step("more")


def prompts(tokenizer, *topics: str, turns: list[int] | None = None) -> list[Prompt]:
    """Dataset-like prompts, tokenized through the chat template as a run prepares them."""
    out = []
    for i, topic in enumerate(topics):
        messages = [{"role": "user", "content": f"Say {topic}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        row = {"topic": topic, "turns": turns[i] if turns else 1}
        prompt = Prompt(index=i, messages=messages, text=text, metadata=row)
        prompt.token_ids = tokenizer(text, add_special_tokens=False).input_ids
        out.append(prompt)
    return out


def rollout(recipe: Recipe, engine, tokenizer, topics=("rain",), G=1, max_context=None):
    fn = MultiTurnRollout(recipe, tokenizer, max_context)
    params = [SamplingParams(8, seed=7)] * len(topics)
    return fn(engine, prompts(tokenizer, *topics), params, G, step=1)


def test_a_scripted_three_turn_episode_has_the_tokens_and_mask_worked_out_by_hand(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a", "bb", "c"])
    (sample,) = rollout(Recipe(environment=ThreeGuesses, max_turns=5), engine, tokenizer)

    eos = [tokenizer.eos_token_id]
    # After each reply but the last, the environment writes the newline that closes the
    # model's turn (the model sampled <|im_end|> itself), the user's "no", and the next
    # generation prompt: 22 tokens, none of them trained.
    feedback = ids(tokenizer, "\n", START, "user\nno", END, "\n", START, "assistant\n")
    assert len(feedback) == 22
    assert sample.prompt_token_ids == ids(tokenizer, START, "user\nGuess rain", END, "\n") + ids(
        tokenizer, START, "assistant\n"
    )
    expected = ids(tokenizer, "a") + eos + feedback + ids(tokenizer, "bb") + eos + feedback
    expected += ids(tokenizer, "c") + eos
    assert sample.response_token_ids == expected
    assert sample.loss_mask == [1] * 2 + [0] * 22 + [1] * 3 + [0] * 22 + [1] * 2
    # The sampler's log-probs of each model token, 0 where the environment wrote.
    turn = lambda n: [-0.1 * (i + 1) for i in range(n)]  # noqa: E731
    assert sample.response_logprobs == pytest.approx(
        turn(2) + [0.0] * 22 + turn(3) + [0.0] * 22 + turn(2)
    )
    assert (sample.status, sample.finish_reason) == ("completed", "stop")
    assert sample.metadata["environment_reward"] == 1.5  # 0.25 + 0.25 + 1
    assert sample.metadata["turns"] == 3 and sample.metadata["last"] == "c"
    assert [(m["role"], m["content"], m.get("trained")) for m in sample.messages] == [
        ("user", "Guess rain", None),
        ("assistant", "a", True),
        ("user", "no", False),
        ("assistant", "bb", True),
        ("user", "no", False),
        ("assistant", "c", True),
    ]
    # The trained sequence is prompt + response; the mask, shifted one left, covers exactly
    # the model's tokens (position t predicts token t + 1).
    batch = build_train_batch([sample], torch.tensor([1.0]), pad_id=0)
    P = len(sample.prompt_token_ids)
    assert batch.input_ids_B_T[0].tolist() == sample.prompt_token_ids + expected
    assert batch.mask_B_T[0, P - 1 : P - 1 + len(expected)].tolist() == sample.loss_mask
    assert batch.sampler_logprobs_B_T[0, P - 1 : P + 1].tolist() == pytest.approx([-0.1, -0.2])
    row = sample_row(sample, 0.5)
    assert row["mask_spans"] == [[0, 2], [24, 27], [49, 51]]
    assert row["messages"] == sample.messages and row["status"] == "completed"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def broken(x: str) -> str:
    """Always fails."""
    raise ValueError("boom")


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_a_tool_call_is_parsed_run_and_masked(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, "It is 5"])
    (sample,) = rollout(Recipe(tools=[add]), engine, tokenizer)

    system = sample.messages[0]
    assert system["role"] == "system"  # the tiny template ignores tools=: they go in the prompt
    schema = json.loads(system["content"].split("<tools>\n")[1].split("\n</tools>")[0])
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["properties"]["a"] == {
        "type": "integer",
        "description": "the first",
    }
    assert [(m["role"], m["content"]) for m in sample.messages[2:]] == [
        ("assistant", CALL),
        ("tool", "5"),
        ("assistant", "It is 5"),
    ]
    mask = sample.loss_mask
    environment = [t for t, m in zip(sample.response_token_ids, mask, strict=True) if not m]
    model = [t for t, m in zip(sample.response_token_ids, mask, strict=True) if m]
    assert tokenizer.decode(environment, skip_special_tokens=False) == (
        f"\n{START}tool\n5{END}\n{START}assistant\n"
    )
    eos = tokenizer.eos_token_id
    assert model == ids(tokenizer, CALL) + [eos] + ids(tokenizer, "It is 5") + [eos]
    assert (sample.status, sample.metadata["turns"]) == ("completed", 2)


def test_a_failing_tool_answers_the_model_or_fails_the_run_as_chosen(tokenizer):
    call = '<tool_call>{"name": "broken", "arguments": {"x": "y"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [call, "ok"])
    (sample,) = rollout(Recipe(tools=[broken]), engine, tokenizer)
    assert sample.messages[3] == {
        "role": "tool",
        "name": "broken",
        "content": "Error: broken raised ValueError: boom",
        "trained": False,
    }
    with pytest.raises(EpisodeError) as failed:
        rollout(Recipe(tools=[broken], tool_error="fail"), engine, tokenizer)
    message = str(failed.value)
    assert "episode 0 (prompt 0, sample 0), turn 1: tool broken" in message
    assert "raised ValueError: boom" in message


def merging_tokenizer():
    """The character tokenizer plus one token for "ab" that encoding never produces."""
    return build_tokenizer(extra_tokens=("ab",))


class MergedReplies(ScriptedEngine):
    """Replies with the single "ab" token, then the end token."""

    def generate_requests(self, requests):
        self.calls.append([r.n for r in requests])
        ab = self.tokenizer.convert_tokens_to_ids("ab")
        completion = Completion([ab, self.tokenizer.eos_token_id], "ab", "stop", [-1.0, -0.5])
        return [[completion] * r.n for r in requests]


def test_the_trained_ids_are_the_sampled_ones_even_where_retokenising_differs():
    tokenizer = merging_tokenizer()
    ab = tokenizer.convert_tokens_to_ids("ab")
    engine = MergedReplies(tokenizer, [])
    recipe = Recipe(environment=ThreeGuesses, max_turns=2)
    (sample,) = rollout(recipe, engine, tokenizer)

    model_ids = [t for t, m in zip(sample.response_token_ids, sample.loss_mask, strict=True) if m]
    assert model_ids == [ab, tokenizer.eos_token_id] * 2
    # Re-tokenising the decoded reply (what the Gym's example does) gives other ids.
    assert tokenizer("ab", add_special_tokens=False).input_ids == ids(tokenizer, "a", "b")
    assert ab not in tokenizer(sample.response, add_special_tokens=False).input_ids
    # The batch trains on the sampled token, at the sampled position, with its log-prob.
    batch = build_train_batch([sample], torch.tensor([1.0]), pad_id=0)
    P = len(sample.prompt_token_ids)
    assert batch.input_ids_B_T[0, P].item() == ab
    assert batch.mask_B_T[0, P - 1].item() == 1.0
    assert batch.sampler_logprobs_B_T[0, P - 1].item() == -1.0


class FailsOnSecondReply(ThreeGuesses):
    def step(self, reply):
        if self.replies == 1:
            raise ValueError("no such guess")
        return super().step(reply)


class Slow(ThreeGuesses):
    async def step(self, reply):
        await asyncio.sleep(30)


class WrongStep(ThreeGuesses):
    def step(self, reply):
        return {"done": True}


class WrongStart(ThreeGuesses):
    def start(self, row):
        return 3


@pytest.mark.parametrize(
    ("environment", "named", "reason"),
    [
        (FailsOnSecondReply, "turn 2: FailsOnSecondReply.step", "raised ValueError: no such guess"),
        (Slow, "turn 1: Slow.step", "timed out after 0.2 s"),
        (WrongStep, "turn 1: WrongStep.step", "returned dict; it must return a Step"),
        (WrongStart, "turn 0: WrongStart.start", "returned 3; messages are a string or a list"),
    ],
)
def test_an_environment_that_fails_is_named_with_its_episode_and_turn(
    tokenizer, environment, named, reason
):
    engine = ScriptedEngine(tokenizer, ["a", "b", "c"])
    recipe = Recipe(environment=environment, environment_timeout_s=0.2)
    with pytest.raises(EpisodeError) as failed:
        rollout(recipe, engine, tokenizer, topics=("rain", "snow"), G=2)
    message = str(failed.value)
    # Every episode fails alike; whichever is reported first, it is named in full.
    assert re.search(r"episode (\d) \(prompt (\d), sample (\d)\), " + re.escape(named), message)
    assert reason in message


def test_max_turns_and_a_full_context_end_the_episode_as_truncated(tokenizer):
    engine = ScriptedEngine(tokenizer, ["abc"])
    (sample,) = rollout(Recipe(environment=Endless, max_turns=3), engine, tokenizer)
    assert (sample.status, sample.finish_reason) == ("truncated", "length")
    assert [m["role"] for m in sample.messages if m.get("trained")] == ["assistant"] * 3

    # The real engine, its context cut to 60 tokens: the prompt takes 21, each "more" message
    # 23 or 24, so the episode runs out of room before its fifth reply, and the engine's
    # replies are cut to the room left.
    model = build_tiny_model(tokenizer)
    real = TorchEngine(model, tokenizer)
    recipe = Recipe(environment=Endless, max_turns=5, max_context_len=60)
    samples = rollout(recipe, real, tokenizer, topics=("rain", "sea"), G=2)
    for sample in samples:
        assert len(sample.prompt_token_ids) + len(sample.response_token_ids) <= 60
        assert (sample.status, sample.finish_reason) == ("truncated", "length")
        assert sum(m.get("trained", False) for m in sample.messages) >= 1


class StopsAfterRowTurns:
    """Ends after the row's ``turns`` replies, so episodes drop out at different turns."""

    def start(self, row):
        self.left = row["turns"]
        return "Go"

    def step(self, reply):
        self.left -= 1
        return Step("again", reward=len(reply), done=self.left == 0)


def test_every_turn_of_a_step_is_one_batched_engine_call(tokenizer):
    engine = CountingEngine(TorchEngine(build_tiny_model(tokenizer), tokenizer))
    fn = MultiTurnRollout(Recipe(environment=StopsAfterRowTurns, max_turns=5), tokenizer)
    params = [SamplingParams(6, seed=s) for s in (1, 2)]
    samples = fn(engine, prompts(tokenizer, "rain", "sea", turns=[1, 3]), params, 3, step=1)
    # Six episodes; those of the first prompt end after one reply, the others after three.
    assert engine.rows_per_call == [6, 3, 3]
    assert fn.engine_calls == 3
    assert [s.metadata["turns"] for s in samples] == [1, 1, 1, 3, 3, 3]
    # Every sample of the step sampled the same first turn as a single-turn group would:
    # the group's first replies came from one request of n=3, so they differ from each other.
    first = [tuple(s.response_token_ids[: s.loss_mask.index(0)]) for s in samples[3:]]
    assert len(set(first)) == 3


async def gym_style_generate(args, sample, sampling_params):
    """The Training Gym's shape: turns by token ids, feedback tokens with mask 0."""
    feedback = args.tokenizer(args.feedback, add_special_tokens=False).input_ids
    response, mask, logprobs = [], [], []
    for turn in range(args.max_turns):
        out = await args.engine.generate(sample.prompt_token_ids + response, sampling_params)
        response += out.token_ids
        mask += [1] * len(out.token_ids)
        logprobs += out.logprobs
        if turn + 1 < args.max_turns:
            response += feedback
            mask += [0] * len(feedback)
            logprobs += [0.0] * len(feedback)
    sample.response_token_ids, sample.loss_mask, sample.response_logprobs = response, mask, logprobs
    sample.metadata["turns_taken"] = args.max_turns
    return sample


async def returns_a_dict(args, sample, sampling_params):
    return {"tokens": []}


async def hangs(args, sample, sampling_params):
    if sample.group_index == 1:
        await asyncio.sleep(30)
    await args.engine.generate(sample.prompt_token_ids, sampling_params)
    return sample


def test_a_custom_generate_function_gets_extra_config_and_batched_turns(tokenizer):
    engine = CountingEngine(TorchEngine(build_tiny_model(tokenizer), tokenizer))
    recipe = Recipe(
        custom_generate_function=gym_style_generate, max_turns=3, extra_config={"feedback": "!"}
    )
    samples = rollout(recipe, engine, tokenizer, topics=("rain", "sea"), G=2)
    assert engine.rows_per_call == [4, 4, 4]
    bang = tokenizer.convert_tokens_to_ids("!")
    for sample in samples:
        assert sample.response_token_ids.count(bang) >= 2
        assert len(sample.response_logprobs) == len(sample.response_token_ids)
        # The trace shows the turns: the model's spans trained, the environment's "!" not.
        spans = [m for m in sample.messages if "trained" in m]
        assert [m["trained"] for m in spans][:2] == [True, False]
        assert [m["content"] for m in spans if not m["trained"]] == ["!", "!"]


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (returns_a_dict, "returns_a_dict returned dict; it must return the Sample"),
        (hangs, "no turn asked for and no end within 0.3 s"),
    ],
)
def test_a_custom_generate_function_that_misbehaves_is_named(tokenizer, fn, reason):
    engine = ScriptedEngine(tokenizer, ["a"])
    recipe = Recipe(custom_generate_function=fn, environment_timeout_s=0.3)
    with pytest.raises(EpisodeError) as failed:
        rollout(recipe, engine, tokenizer, G=2)
    assert reason in str(failed.value) and "episode" in str(failed.value)


def test_recipe_fields_are_checked_naming_them():
    with pytest.raises(ValueError, match="extra_config key 'max_turns' is a Recipe field"):
        Recipe(extra_config={"max_turns": 3})
    with pytest.raises(ValueError, match="custom_generate_function runs its own episode loop"):
        Recipe(custom_generate_function=gym_style_generate, tools=[add])
    with pytest.raises(ValueError, match="module:function"):
        Recipe(environment="NoColon")

    def untyped(x):
        """Has no annotation."""

    with pytest.raises(ToolError, match="tool untyped: parameter 'x' has no type annotation"):
        MultiTurnRollout(Recipe(tools=[untyped]), build_tokenizer())
    recipe = Recipe(environment=ThreeGuesses, tools=[add])
    assert recipe.custom_rm_function == "palaestra.rollout.environments:environment_reward"
    dumped = recipe.to_json_dict()
    assert dumped["environment"] == "test_multiturn:ThreeGuesses"
    assert dumped["tools"] == ["test_multiturn:add"]


class FakeEndpoint:
    """Replies "guess <n>" where n counts the messages it was sent."""

    name, info = "fake", {}

    def __init__(self) -> None:
        self.sent: list[list[dict]] = []

    def wait_until_ready(self, timeout=None) -> None: ...

    def chat_completion(self, messages, **kwargs):
        self.sent.append([dict(m) for m in messages])
        return {
            "choices": [{"message": {"role": "assistant", "content": f"guess {len(messages)}"}}]
        }


def test_an_eval_config_with_an_environment_plays_episodes_against_an_endpoint(home, prompts_file):
    dataset = LocalDataset(path=str(prompts_file), input_column="topic")
    endpoint = FakeEndpoint()
    config = EvalConfig(dataset, environment=ThreeGuesses, max_turns=5)
    result = config.evaluate(endpoint, max_concurrency=2, show_progress=False)
    assert result.total == 6 and result.mean == 1.5  # 0.25 + 0.25 + 1 in every episode
    row = next(r for r in result.rows if r["index"] == 0)
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"] * 3
    assert [m["content"] for m in row["messages"]][1::2] == ["guess 1", "guess 3", "guess 5"]
    assert row["turns"] == 3 and row["response"] == "guess 5"
    saved = json.loads(Path(result.path).read_text())
    assert saved["rows"][0]["messages"][0]["content"].startswith("Guess ")


def test_an_aborted_episode_stays_in_the_batch_but_is_never_trained_on(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a", "b"])
    done, aborted = rollout(Recipe(environment=ThreeGuesses), engine, tokenizer, G=2)
    aborted.status = "aborted"
    batch = build_train_batch([done, aborted], torch.tensor([1.0, -1.0]), pad_id=0)
    assert batch.mask_B_T[0].sum().item() == sum(done.loss_mask) == 6  # "a", "b", "b" + ends
    assert batch.mask_B_T[1].sum().item() == 0.0
    assert batch.attention_mask_B_T[1].sum().item() == len(aborted.prompt_token_ids) + len(
        aborted.response_token_ids
    )
