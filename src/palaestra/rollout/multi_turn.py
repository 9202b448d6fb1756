"""Multi-turn rollout: the Training Gym's custom generate contract, on palaestra's own engine.

``Recipe.custom_generate_function`` is ``async def fn(args, sample, sampling_params) -> Sample``,
run once per episode (``n_samples_per_prompt`` episodes per prompt). It asks for each turn with
``await args.engine.generate(token_ids, sampling_params)`` (token ids in; a ``Turn`` of sampled
ids, log-probs, text and finish reason out; no server) and sets the sample's
``response_token_ids``, ``loss_mask`` (1: sampled by the model, 0: written by the environment),
``response_logprobs``, ``status`` and ``metadata`` for the reward. ``args`` has the recipe's
fields, ``extra_config``'s keys, ``engine`` and ``tokenizer`` as attributes.

Every episode of a step runs as a task on one event loop. ``args.engine`` holds each request
until every live episode is waiting on it or done, then sends them all to the engine in one
batched call: a step's turns cost one engine call each, however many episodes there are. An
episode that ends drops out of the next call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from palaestra.calls import call
from palaestra.engine import GenerationRequest, RolloutEngine, SamplingParams
from palaestra.rewards import RewardError, resolve_reward
from palaestra.rollout.environments import run_environment
from palaestra.rollout.episode import Episode, EpisodeError, Turn, current_episode, episode_context
from palaestra.rollout.single_turn import make_sample
from palaestra.rollout.tools import tool_schema
from palaestra.types import Completion, Prompt, Sample

STATUSES = ("completed", "truncated", "aborted")


@dataclass
class _Pending:
    episode: Episode
    token_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    turn: int


class TurnClient:
    """``args.engine``: the next turn of the calling episode, batched with every other live
    episode's. ``threads`` runs blocking work (sync environment methods and tools)."""

    def __init__(self, engine: RolloutEngine, max_context: int | None) -> None:
        self.engine = engine
        self.max_context = max_context
        """Most tokens (prompt and every turn) an episode may hold; None: no limit."""
        self.threads = ThreadPoolExecutor(8, thread_name_prefix="palaestra-episode")
        self.engine_calls = 0
        self._pending: list[_Pending] = []
        self._changed: asyncio.Event | None = None

    async def generate(
        self, token_ids: list[int], sampling_params: SamplingParams | None = None, **overrides: Any
    ) -> Turn:
        """The model's next turn after ``token_ids`` (prompt and turns so far), sampled with
        ``sampling_params`` (default: the episode's) and ``overrides`` (``max_tokens=8``)."""
        episode = current_episode()
        params = dataclasses.replace(sampling_params or episode.params, **overrides)
        if self.max_context is not None:
            room = self.max_context - len(token_ids)
            if room < 1:
                return Turn([], [], "", "length")
            params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(episode, list(token_ids), params, future, episode.turn))
        episode.turn += 1
        self._notify()
        return await future

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def waiting(self) -> set[int]:
        return {p.episode.position for p in self._pending}

    def flush(self) -> None:
        """Every pending turn, in one engine call."""
        pending, self._pending = sorted(self._pending, key=lambda p: p.episode.position), []
        requests, owners = _requests(pending)
        self.engine_calls += 1
        completions_R_N = self.engine.generate_requests(requests)
        for owned, completions in zip(owners, completions_R_N, strict=True):
            for item, completion in zip(owned, completions, strict=True):
                item.future.set_result(_turn(completion))

    async def drive(self, tasks: dict[asyncio.Task, Episode], timeout: float | None) -> None:
        """Run ``tasks`` to the end, flushing each time every live one waits on a turn. A round
        in which some episode neither asks for a turn nor ends within ``timeout`` fails."""
        self._changed = asyncio.Event()
        for task in tasks:
            task.add_done_callback(lambda _: self._notify())
        live = dict(tasks)
        while live:
            try:
                async with asyncio.timeout(timeout):
                    await self._all_waiting(live)
            except TimeoutError:
                late = [e for e in live.values() if e.position not in self.waiting()]
                raise EpisodeError(
                    f"{late[0].describe()}: no turn asked for and no end within {timeout} s "
                    f"(environment_timeout_s); {len(late)} episode(s) stuck"
                ) from None
            if self._pending:
                self.flush()

    async def _all_waiting(self, live: dict[asyncio.Task, Episode]) -> None:
        """Return once every live task waits on a turn (ended ones are dropped from ``live``);
        an episode's error is raised here."""
        while True:
            for task in [t for t in live if t.done()]:
                del live[task]
                task.result()
            if not live or {e.position for e in live.values()} <= self.waiting():
                return
            self._changed.clear()
            await self._changed.wait()


def _requests(pending: list[_Pending]) -> tuple[list[GenerationRequest], list[list[_Pending]]]:
    """One request per pending turn, except that a group's first turns from one prompt become
    one request of ``n`` rows (the prompt is prefilled once), seeded like a single-turn group."""
    requests, owners = [], []
    i = 0
    while i < len(pending):
        first = pending[i]
        group = [first]
        if first.turn == 0 and first.episode.group_index == 0:
            for item in pending[i + 1 :]:
                same = item.turn == 0 and item.token_ids == first.token_ids
                same = same and item.params == first.params
                if not (same and item.episode.group_index == len(group)):
                    break
                if item.episode.prompt is not first.episode.prompt:
                    break
                group.append(item)
        if len(group) > 1:
            requests.append(GenerationRequest(first.token_ids, len(group), first.params))
        else:
            seed = first.params.seed
            if seed is not None:
                seed = turn_seed(seed, first.episode.group_index, first.turn)
            params = dataclasses.replace(first.params, seed=seed)
            requests.append(GenerationRequest(first.token_ids, 1, params))
        owners.append(group)
        i += len(group)
    return requests, owners


def turn_seed(seed: int, group_index: int, turn: int) -> int:
    """The seed of one episode's turn: from the group's seed, the episode and the turn."""
    digest = hashlib.blake2b(f"{seed}/{group_index}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _turn(completion: Completion) -> Turn:
    return Turn(
        list(completion.token_ids),
        None if completion.logprobs is None else list(completion.logprobs),
        completion.text,
        completion.finish_reason,
    )


class RunArgs:
    """The ``args`` a custom generate function (and with ``extra_config``, a reward) receives:
    ``extra_config``'s keys and ``attributes``, then the recipe's fields, as attributes."""

    def __init__(self, recipe, **attributes: Any) -> None:
        self._recipe = recipe
        self.__dict__.update(recipe.extra_config)
        self.__dict__.update(attributes)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._recipe, name)

    def __repr__(self) -> str:
        return f"RunArgs({type(self._recipe).__name__}, extra={sorted(self._recipe.extra_config)})"


class MultiTurnRollout:
    """A rollout function (``RolloutFn``) that runs ``fn`` once per episode, all episodes of a
    step at once. ``fn`` defaults to the recipe's ``custom_generate_function``, else the
    built-in loop over ``Recipe.environment`` and ``Recipe.tools``."""

    def __init__(
        self, recipe, tokenizer, max_context: int | None = None, fn: Callable | None = None
    ) -> None:
        self.recipe = recipe
        self.tokenizer = tokenizer
        limits = [n for n in (max_context, recipe.max_context_len) if n is not None]
        self.max_context = min(limits) if limits else None
        chosen = fn or recipe.custom_generate_function
        self.fn = (
            resolve_function(chosen, "custom_generate_function") if chosen else run_environment
        )
        self.custom = chosen is not None
        for tool in recipe.tools:
            tool_schema(tool)  # a tool the model cannot be told about fails before any step
        self.environment = None
        if recipe.environment is not None:
            self.environment = resolve_function(recipe.environment, "environment")
        self.engine_calls = 0
        """Engine calls made so far (one per turn of a step)."""

    def __call__(
        self,
        engine: RolloutEngine,
        prompts_P: list[Prompt],
        params_P: list[SamplingParams],
        G: int,
        step: int,
    ) -> list[Sample]:
        client = TurnClient(engine, self.max_context)
        try:
            samples_B = asyncio.run(self._run(client, prompts_P, params_P, G, step))
        finally:
            client.threads.shutdown(wait=False, cancel_futures=True)
            self.engine_calls += client.engine_calls
        version = engine.weight_version
        for sample in samples_B:
            sample.weight_version = version
        return samples_B

    async def _run(self, client, prompts_P, params_P, G, step) -> list[Sample]:
        args = RunArgs(
            self.recipe, engine=client, tokenizer=self.tokenizer, environment=self.environment
        )
        tasks: dict[asyncio.Task, Episode] = {}
        for p, (prompt, params) in enumerate(zip(prompts_P, params_P, strict=True)):
            for g in range(G):
                episode = Episode(p * G + g, prompt, g, params)
                blank = Completion([], "", "stop", None)
                sample = make_sample(prompt, blank, g, step)
                context = episode_context(episode)
                coroutine = self._episode(args, sample, episode)
                tasks[asyncio.create_task(coroutine, context=context)] = episode
        # Only custom functions get a round timeout: the built-in loop times each call itself.
        timeout = self.recipe.environment_timeout_s if self.custom else None
        try:
            await client.drive(tasks, timeout)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [task.result() for task in tasks]

    async def _episode(self, args, sample: Sample, episode: Episode) -> Sample:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        result = await call(
            self.fn,
            (args, sample, episode.params),
            where=lambda: f"{episode.describe()}: {name}",
            threads=args.engine.threads,
            error=EpisodeError,
            passes=(EpisodeError,),  # the built-in loop's own, already naming the episode
        )
        return self._checked(result, episode, name)

    def _checked(self, sample: Any, episode: Episode, name: str) -> Sample:
        """``sample`` if it is a consistent episode, else an EpisodeError saying what is wrong."""
        where = f"{episode.describe()}: {name}"
        if not isinstance(sample, Sample):
            raise EpisodeError(
                f"{where} returned {type(sample).__name__}; it must return the Sample"
            )
        n = len(sample.response_token_ids)
        for field_name in ("loss_mask", "response_logprobs"):
            value = getattr(sample, field_name)
            if value is not None and len(value) != n:
                raise EpisodeError(
                    f"{where} set {len(value)} {field_name} entries for {n} response tokens"
                )
        if sample.loss_mask is not None and set(sample.loss_mask) - {0, 1}:
            raise EpisodeError(f"{where}: loss_mask entries must be 0 or 1")
        if sample.status not in STATUSES:
            raise EpisodeError(f"{where} set status {sample.status!r}; one of {STATUSES}")
        total = len(sample.prompt_token_ids) + n
        if self.max_context is not None and total > self.max_context:
            raise EpisodeError(
                f"{where}: the episode holds {total} tokens, more than the context of "
                f"{self.max_context}; end it as truncated when a turn comes back with "
                "finish_reason 'length' and no tokens"
            )
        if sample.status == "truncated":
            sample.finish_reason = "length"
        if self.custom and len(sample.messages) <= len(episode.prompt.messages):
            sample.messages = list(sample.messages) + segments(self.tokenizer, sample)
        return sample


def resolve_function(value: Callable | str, field_name: str) -> Callable:
    """A callable from a callable or a ``"module:function"`` string; errors name the field."""
    try:
        return resolve_reward(value)
    except RewardError as error:
        raise ValueError(f"recipe.{field_name}: {error}") from None


def segments(tokenizer, sample: Sample) -> list[dict[str, Any]]:
    """The response as messages, one per run of equal mask values: the model's spans
    (``"trained": True``) and the environment's, for a trace that shows turns."""
    mask = sample.response_mask()
    out: list[dict[str, Any]] = []
    start = 0
    for end in range(1, len(mask) + 1):
        if end == len(mask) or mask[end] != mask[start]:
            text = tokenizer.decode(sample.response_token_ids[start:end], skip_special_tokens=True)
            trained = bool(mask[start])
            role = "assistant" if trained else "environment"
            out.append({"role": role, "content": text, "trained": trained})
            start = end
    return out
