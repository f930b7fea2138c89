"""`trainmon export`: the Parquet dataset answers the post-mortem question as nan-analyze does."""
import json
import sys
from pathlib import Path

import pytest

from test_anomaly_online import STATS, faulty_run
from trainmon.cli import main as cli_main

duckdb = pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from generate_run import write_rank  # noqa: E402  (the benchmark run, small)

# The README's query: the first non-finite record of the run, in the ordering key's order.
FIRST = """
SELECT rank, step, micro_step, module, phase, tensor, call_index
FROM read_parquet('{out}/**/*.parquet', hive_partitioning = true)
WHERE nonfinite
ORDER BY order_step, order_micro_step, order_phase, order_vpp, order_pp, order_call_index, rank
LIMIT 1
"""
WHERE = ("rank", "step", "micro_step", "module", "phase", "tensor", "call_index")


def _first(out) -> dict:
    return dict(zip(WHERE, duckdb.sql(FIRST.format(out=out)).fetchall()[0]))


def _nan_analyze(run, capsys) -> dict:
    assert cli_main(["nan-analyze", str(run), "--json", "--quiet"]) == 1  # 1: a NaN/Inf found
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("formats", [["csv", "db"], ["csv"]], ids=["db", "csv_only"])
def test_duckdb_first_nonfinite_record_equals_nan_analyze(output_dir, write_config, tmp_path, capsys, formats):
    monitor, _ = faulty_run(write_config, "forward_output_inf", {**STATS, "format": formats})
    run = monitor.output_dir.parent
    out = tmp_path / "dataset"
    assert cli_main(["export", str(run), str(out), "--quiet"]) == 0
    capsys.readouterr()
    first = _nan_analyze(run, capsys)["first"]
    if "db" not in formats:  # CSV rows carry no call index; nan-analyze has it from anomalies.jsonl
        first["call_index"] = None
    assert _first(out) == first
    assert (out / "family=actv" / "rank=0" / "part-0.parquet").is_file()


def test_a_run_over_ranks_keeps_nan_and_inf_and_refuses_a_non_empty_output(tmp_path, capsys):
    run = tmp_path / "run"
    for rank in range(3):
        write_rank((run, rank, 3, 5, 1, 2))
    out = tmp_path / "dataset"
    assert cli_main(["export", str(run), str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert _first(out) == _nan_analyze(run, capsys)["first"]
    rows = duckdb.sql(f"SELECT count(*), count(DISTINCT rank), sum(raw_infs) FROM "
                      f"read_parquet('{out}/**/*.parquet', hive_partitioning = true)").fetchall()[0]
    assert rows[0] == 3 * 5 * 66 and rows[1] == 3 and rows[2] > 0
    norms = duckdb.sql(f"SELECT rank, step, norm FROM read_parquet('{out}/**/*.parquet', hive_partitioning = true) "
                       "WHERE family = 'grad_reduced' AND name = 'layers.0.mlp.0.weight' ORDER BY rank, step").fetchall()
    assert len(norms) == 15
    assert cli_main(["export", str(run), str(out), "--quiet"]) == 2
    assert str(out) in capsys.readouterr().err
    assert cli_main(["export", str(run), str(out), "--quiet", "--overwrite"]) == 0
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}/**/*.parquet')").fetchall()[0][0] == 3 * 5 * 66


@pytest.mark.parametrize("place", ["under_a_file", "read_only"])
def test_an_output_that_cannot_be_written_is_one_line_and_status_2(tmp_path, capsys, monkeypatch, place):
    import trainmon.output_dir
    run = tmp_path / "run"
    write_rank((run, 0, 1, 2, 1, 2))
    (tmp_path / "file").write_text("a file where a directory should be")
    out = tmp_path / "file" / "dataset"
    if place == "read_only":  # what a directory without write permission answers (the tests may run as root)
        out = tmp_path / "dataset"
        monkeypatch.setattr(trainmon.output_dir.os, "access", lambda path, mode: False)
    assert cli_main(["export", str(run), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trainmon export: {out}: ") and len(err.splitlines()) == 1, err
