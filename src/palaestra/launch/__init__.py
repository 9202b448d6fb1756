"""Launching: starting and stopping the processes palaestra runs in the background.

``process`` is the one helper that spawns and stops them (training runs and endpoint servers
alike), after the first forked from ``warm``'s launcher, which has imported torch already;
``training`` creates runs, starts their worker and holds TrainingRun, the handle that waits
on, stops and resumes a run; ``worker`` is the training process itself; ``checks`` says,
before anything starts, whether the Ray backend can run a recipe here (and lays out its GPUs);
``plan_check`` runs the plan check in a process forked from the warm launcher where one is ready.
"""
