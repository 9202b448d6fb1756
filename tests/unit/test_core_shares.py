"""How the Ray backend splits a node's cores into torch threads (backends.ray.core_shares)."""

from palaestra.backends.ray import core_shares


def test_alternating_the_learner_takes_its_whole_node():
    # One 2-core node, one worker: they take turns, so each may use both cores.
    assert core_shares([("a", 1, 2), ("a", 2, 2)], overlapped=False) == [2, 2]
    # 16 cores beside two workers, 4 elsewhere shared by four: 16; 8, 8; 1, 1, 1, 1.
    where = [("a", 1, 16), ("a", 2, 16), ("a", 3, 16)] + [("b", p, 4) for p in (4, 5, 6, 7)]
    assert core_shares(where, overlapped=False) == [16, 8, 8, 1, 1, 1, 1]


def test_sampling_ahead_the_learner_is_one_more_on_its_node():
    # Learner and worker run at once on 2 cores: one thread each, not two each.
    assert core_shares([("a", 1, 2), ("a", 2, 2)], overlapped=True) == [1, 1]
    # Three on node a's 16 cores (5 each, 1 left over); node b is unchanged.
    where = [("a", 1, 16), ("a", 2, 16), ("a", 3, 16)] + [("b", p, 4) for p in (4, 5, 6, 7)]
    assert core_shares(where, overlapped=True) == [5, 5, 5, 1, 1, 1, 1]
    # A learner alone on its node keeps all of it.
    assert core_shares([("a", 1, 8), ("b", 2, 4)], overlapped=True) == [8, 4]
