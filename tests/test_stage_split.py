"""The pruned stage split gives exactly the full dynamic programme's answer (random costs with
zeros, ties, a heavy embedding), and a deep model's split stays fast."""

from __future__ import annotations

import random
import resource

from nanotrain.config.schema import MAX_LAYERS
from nanotrain.parallel.stage_split import balanced_split

from helpers.stage_split_reference import reference_split


def test_same_split_as_the_full_programme():
    rng = random.Random(0)
    for _ in range(1500):
        n = rng.randint(1, 24)
        kind = rng.choice(["spiky", "small", "uniform"])
        costs = [
            rng.choice([0, 1, 2, 5, 100]) if kind == "spiky" else rng.randint(1, 3) if kind == "small" else 4
            for _ in range(n)
        ]
        costs[0] = rng.choice([costs[0], rng.randint(0, 50)])  # an embedding heavier than a layer, or not
        parts = rng.randint(1, n)
        assert balanced_split(costs, parts) == reference_split(costs, parts), (costs, parts)


def test_deepest_model_splits_fast():
    costs = [20] + [3] * MAX_LAYERS + [20]  # embedding, layers, head
    before = resource.getrusage(resource.RUSAGE_SELF)
    for parts in (2, 64, 256, 512, MAX_LAYERS):
        balanced_split(costs, parts)
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime < 2.0
