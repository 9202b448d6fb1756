"""Backends: each builds a run's sampler and learner (``train.seam``) from its config."""
