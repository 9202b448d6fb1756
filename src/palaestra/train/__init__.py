"""Training: the config, the loop, the learner, batches and checkpoints."""
