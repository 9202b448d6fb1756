"""Rollout: the rollout functions that turn prompts into samples (single-turn, and episodes of
an environment with tools), and the sampler that scores them into groups. The engines they
sample from live in ``palaestra.engine``."""
