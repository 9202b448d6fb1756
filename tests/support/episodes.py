"""A two-turn environment for the tiny model and the reward that reads its episodes' score, shared
by the multi-turn run, Ray and dashboard tests."""

from __future__ import annotations

from palaestra.types import Step


class LowercaseGame:
    """Two replies per episode; each is rewarded by its lowercase letters, so groups differ."""

    def start(self, row):
        self.replies = 0
        return f"Talk about {row['topic']}"

    def step(self, reply):
        self.replies += 1
        return Step("more", reward=sum(c.islower() for c in reply), done=self.replies == 2)


def episode_reward(args, sample, **kwargs) -> float:
    return float(sample.metadata["environment_reward"])
