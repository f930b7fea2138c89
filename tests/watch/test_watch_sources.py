"""What the daemon follows: every run under a root, CSV-only ranks, and the per-rank series of `--ranks`."""
import math
import shutil

import pytest

from runs import read_events, watch_once


@pytest.mark.slow
def test_root_csv_only_run_and_ranks_flag(finished_run, tmp_path):
    root = tmp_path / "monitor_output"
    shutil.copytree(finished_run, root / "run-a")
    shutil.copytree(finished_run, root / "run-b")
    for rank_dir in (root / "run-b").glob("rank_*"):
        (rank_dir / "monitor.db").unlink()  # run-b: CSV files (and anomalies.jsonl) only
    done = watch_once(root, "--ranks", 1, "--heatmap-every", 1000)
    assert done.returncode == 0, done.stderr
    from_db, from_csv = read_events(root / "watch" / "run-a")[0], read_events(root / "watch" / "run-b")[0]
    tag = "grad_reduced/norm of layers.2"
    assert [s for s, _ in from_db[tag]] == [s for s, _ in from_csv[tag]] == list(range(60))
    # the CSV files keep 8 significant digits; TensorBoard float32
    assert all(a == b or abs(a - b) <= 1e-6 * abs(a) or math.isnan(a) and math.isnan(b)
               for (_, a), (_, b) in zip(from_db[tag], from_csv[tag]))
    assert math.isnan(from_db[tag][-1][1])  # the norm of a tensor holding an Inf, drawn as TensorBoard draws NaN
    assert "rank1/grad_reduced/layers.2/layers.2.mlp.0.weight/norm" in from_db
    assert not any(t.startswith("rank0/") for t in from_db), "only the ranks --ranks names get their own series"
    for run in ("run-a", "run-b"):
        assert (root / "watch" / run / "alerts.jsonl").exists()
