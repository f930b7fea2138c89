"""nan-analyze over many ranks: read in worker processes and merged by the ordering key, same answer."""
import sys
from pathlib import Path

from trainmon.analysis.nan_analyze import analyze
from trainmon.commands.anomalies import top_anomalies
from trainmon.read import parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from generate_run import write_rank  # noqa: E402  (the benchmark run, small)


def test_ranks_read_in_processes_give_the_answer_read_in_one(tmp_path, monkeypatch):
    ranks = parallel.PARALLEL_FROM + 1
    for rank in range(ranks):
        write_rank((tmp_path, rank, ranks, 6, 4, 3))
    merged, top = analyze(tmp_path), top_anomalies(tmp_path, 30)
    assert merged["first"]["rank"] == 4 and merged["first"]["step"] == 3
    assert merged["cross_rank"]["origin_rank"] == 4
    assert [e.where() for e in top[:1]] == [merged["first"]] and len(top) == 30
    monkeypatch.setattr(parallel, "PARALLEL_FROM", ranks + 1)  # one process
    assert analyze(tmp_path) == merged and top_anomalies(tmp_path, 30) == top
