"""The cross-rank reduction: its matrix form agrees with the sort of every value, and a finished run read and
reduced in worker processes (`--once` over many ranks) gives the events of one read in the daemon's process."""
import math
import os
from pathlib import Path

import numpy as np
import pytest

from runs import generate, read_events
from trainmon.read.layout import find_run
from trainmon.read.parallel import PARALLEL_FROM
from trainmon.watch.aggregate import layer_of, reduce_groups, reduce_matrix, step_figures
from trainmon.watch.chunk import OpenReaders, RankChunk
from trainmon.watch.follow import RankFollower
from trainmon.watch.rank_matrix import AlignedRanks
from trainmon.watch.run_watcher import RunWatcher, WatchOptions, read_figures
from trainmon.writers.db_schema import NO_MICRO_STEP


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


@pytest.mark.slow  # worker processes over many ranks
def test_workers_give_the_events_of_the_daemons_process(tmp_path):
    run = generate(tmp_path / "run", ranks=PARALLEL_FROM, steps=30, inf_step=20, origin=5)
    (got, got_steps), (want, want_steps) = _export(run, tmp_path / "workers", True), _export(run, tmp_path / "here", False)
    assert len(want) > 1000 and got.keys() == want.keys()
    for tag, values in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in values], tag
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for (_, a), (_, b) in zip(got[tag], values)), tag
    assert got_steps == want_steps  # the heatmaps too, drawn at the same steps
    assert (tmp_path / "workers" / "heatmaps").is_dir()


def _chunks(seed: int, shuffled: bool) -> list:
    """Ranks that recorded the same tensors in the same order (whole-step records, and records of each
    micro-step), with NaN, both infinities and figures without a value; `shuffled`: each rank's rows in an order
    of its own, which no longer follows one sequence."""
    rng = np.random.default_rng(seed)
    keys = [("actv", f"layers.{i}.output", 0) for i in range(3)] + [("grad_reduced", f"layers.{i}.weight", 0)
                                                                    for i in range(2)]
    micros = int(rng.integers(1, 4))
    sequence = [(step, tag, micro) for step in range(5, 9) for tag in range(len(keys))
                for micro in (range(micros) if tag < 3 else [NO_MICRO_STEP])]
    chunks = []
    for rank in rng.permutation(6)[:int(rng.integers(2, 6))].tolist():
        values, present = {}, {}
        for op in ("norm", "max", "nans"):
            pool = [0.0, 1.0, 2.0, -3.0, math.nan, math.inf, -math.inf]
            values[op] = rng.choice(pool, size=len(sequence)) if seed % 2 else rng.normal(size=len(sequence))
            present[op] = rng.random(len(sequence)) < 0.9
        order = rng.permutation(len(sequence))
        order = order if shuffled else np.arange(len(sequence))
        step, tag, micro = (np.array([sequence[i][k] for i in order], dtype=np.int64) for k in range(3))
        chunks.append(RankChunk(rank, keys, step, tag, micro, {op: v[order] for op, v in values.items()},
                                {op: p[order] for op, p in present.items()}))
    return sorted(chunks, key=lambda chunk: chunk.rank)


@pytest.mark.parametrize("seed", range(20))
def test_ranks_that_follow_one_sequence_give_the_figures_of_the_sorted_reduction(seed):
    """Their matrices are gathered from the ranks' rows (`AlignedRanks`); shuffled, the same records are reduced
    by the sort of every value."""
    spread = ("norm", lambda family, name, vpp: layer_of(name))
    aligned, shuffled = _chunks(seed, False), _chunks(seed, True)
    got, want = step_figures(aligned, spread=spread), step_figures(shuffled, spread=spread)
    assert got.keys() == want.keys()
    for step, figure in want.items():
        for name in ("stats", "layer_spread"):
            ours, theirs = getattr(got[step], name), getattr(figure, name)
            assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k], equal_nan=True)
                                                         for k in theirs), (step, name)
    rows = [np.concatenate([getattr(c, f) for c in aligned]) for f in ("tag", "micro", "step")]
    ranks = np.array([c.rank for c in aligned])
    rank = np.repeat(ranks, [len(c.step) for c in aligned])
    assert AlignedRanks.of(rows[2] * 10 + rows[0], rows[1] - NO_MICRO_STEP, rank, ranks) is not None


@pytest.mark.slow
def test_readers_kept_open_between_spans_stop_at_their_limit(tmp_path):
    """--once's workers keep up to `limit` ranks' databases open from one span to the next, with the figures of
    fresh reads; the daemon following a live run (no limit) holds none open after a read."""
    run = generate(tmp_path / "run", ranks=3, steps=6, inf_step=4)
    followers = [RankFollower(d) for d in find_run(run).ranks]
    fresh = read_figures(followers, 0, 5)
    assert _open_databases(run) == set()
    readers = OpenReaders(limit=2)
    for first, last in ((0, 2), (3, 5), (0, 5)):
        kept = read_figures(followers, first, last, readers=readers)
        assert {step: figure.stats for step, figure in kept.items()} == \
            {step: fresh[step].stats for step in range(first, last + 1)}
        assert _open_databases(run) == {str(f.rank_dir.db) for f in followers[:2]}


def _open_databases(run: Path) -> set[str]:
    """The monitor databases of `run` this process has open (not those an earlier test left open elsewhere)."""
    links = (os.readlink(link) for link in Path("/proc/self/fd").iterdir() if link.exists())
    return {path for path in links if path.endswith("monitor.db") and path.startswith(str(run))}


@pytest.mark.slow
def test_a_finished_runs_databases_are_read_ahead_and_a_live_runs_are_not(tmp_path, monkeypatch):
    """--once reads each rank whole, span after span: its database is read ahead once, in one sequential read; the
    daemon following a live run reads a few new steps a poll, and only those pages."""
    run = generate(tmp_path / "run", ranks=2, steps=4, inf_step=3)
    followers = [RankFollower(d) for d in find_run(run).ranks]
    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: (
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), advice)), real(fd, offset, length, advice)))
    read_figures(followers, 0, 3)
    assert advised == []
    readers = OpenReaders(limit=2)
    for first in (0, 2):
        read_figures(followers, first, first + 1, readers=readers)
    assert advised == [(str(f.rank_dir.db), os.POSIX_FADV_WILLNEED) for f in followers]
