"""The RL math: advantages and losses as pure functions over tensors, no I/O."""
