"""What the post-mortem reads of a rank: work that follows its non-finite records, not the length of the run, and
a small database read ahead in one pass rather than page by page."""
import os
import sys
from pathlib import Path

import pytest

from trainmon.analysis.rank_summary import summarize_rank_dir
from trainmon.read import read_ahead
from trainmon.read.database import DbRankReader
from trainmon.read.layout import find_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from generate_run import write_rank  # noqa: E402  (the benchmark run, small)

NONFINITE_STEPS = 3  # an Inf enters at the third step from the end, then every record holds one


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    """Runs of 20 and 80 steps, one rank each, whose last NONFINITE_STEPS steps are non-finite."""
    out = {}
    for steps in (20, 80):
        out[steps] = tmp_path_factory.mktemp(f"steps{steps}")
        write_rank((out[steps], 0, 2, steps, 0, steps - NONFINITE_STEPS))
    return out


def _summary_work(run: Path) -> int:
    """SQLite's virtual-machine instructions for one rank's post-mortem summary (the rows and index entries it
    visits, whatever the machine's speed)."""
    reader = DbRankReader(find_run(run).ranks[0].db)
    ticks = []
    reader.conn.set_progress_handler(lambda: ticks.append(1), 100)
    try:
        found = reader.nonfinite(0)
    finally:
        reader.close()
    assert found.records == 47 + 66 * (NONFINITE_STEPS - 1)  # the Inf step's, then every record
    return len(ticks)


def test_a_rank_summary_visits_the_nonfinite_records_not_every_step(runs):
    short, long = _summary_work(runs[20]), _summary_work(runs[80])
    assert long <= short * 1.05, (short, long)


def test_the_post_mortem_reads_a_small_database_ahead(runs, monkeypatch):
    rank_dir = find_run(runs[20]).ranks[0]
    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: (
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice)), real(fd, offset, length, advice)))
    summary = summarize_rank_dir(rank_dir)
    assert advised == [(str(rank_dir.db), 0, 0, os.POSIX_FADV_WILLNEED)]
    advised.clear()
    monkeypatch.setattr(read_ahead, "READ_AHEAD_BELOW", rank_dir.db.stat().st_size)
    assert summarize_rank_dir(rank_dir) == summary and advised == []  # a large file: its pages as queries need them
