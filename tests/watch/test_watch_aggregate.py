"""The cross-rank reduction: its matrix form agrees with the sort of every value, and a finished run read and
reduced in worker processes (`--once` over many ranks) gives the events of one read in the daemon's process."""
import math

import numpy as np
import pytest

from runs import generate, read_events
from trainmon.read.parallel import PARALLEL_FROM
from trainmon.watch.aggregate import reduce_groups, reduce_matrix
from trainmon.watch.run_watcher import RunWatcher, WatchOptions


@pytest.mark.parametrize("seed", range(40))
def test_the_matrix_reduction_equals_the_sorted_one(seed):
    rng = np.random.default_rng(seed)
    groups, ranks, micros = rng.integers(1, 20), rng.integers(1, 10), rng.integers(1, 3)
    cells = [(g, r, m) for g in range(groups) for r in range(ranks) for m in range(micros)
             if rng.random() < 0.8]
    order = rng.permutation(len(cells))
    group, rank_pos, micro = (np.array([cells[i][k] for i in order], dtype=np.int64) for k in range(3))
    # ties, NaN and both infinities are common here: they decide the median, the max and its rank
    pool = [0.0, 1.0, 2.0, -3.0, math.nan, math.inf, -math.inf]
    value = rng.choice(pool, size=len(group)) if seed % 2 else rng.normal(size=len(group))
    rank_ids = np.arange(ranks) * 4 + 1  # ranks are not positions
    got = reduce_matrix(group, rank_pos * micros + micro, np.repeat(rank_ids, micros), value)
    want = reduce_groups(group, rank_ids[rank_pos], value)
    for name, a, b in zip(("groups", "min", "median", "max", "max rank"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_shared_slot_is_left_to_the_sort():
    group, slot = np.array([0, 0]), np.array([1, 1])  # one tensor recorded twice in a micro-step
    assert reduce_matrix(group, slot, np.array([0, 1]), np.array([1.0, 2.0])) is None


def _export(run, logdir, once):
    watcher = RunWatcher(run, logdir, WatchOptions(once=once, heatmap_every=15, detail=(".",), ranks=frozenset({5})))
    watcher.poll(final=True)
    watcher.finish()
    return read_events(logdir)


def test_workers_give_the_events_of_the_daemons_process(tmp_path):
    run = generate(tmp_path / "run", ranks=PARALLEL_FROM, steps=30, inf_step=20, origin=5)
    (got, got_steps), (want, want_steps) = _export(run, tmp_path / "workers", True), _export(run, tmp_path / "here", False)
    assert len(want) > 1000 and got.keys() == want.keys()
    for tag, values in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in values], tag
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for (_, a), (_, b) in zip(got[tag], values)), tag
    assert got_steps == want_steps  # the heatmaps too, drawn at the same steps
    assert (tmp_path / "workers" / "heatmaps").is_dir()
