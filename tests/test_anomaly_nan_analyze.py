"""`trainmon nan-analyze` and `trainmon anomalies` across ranks, and on truncated or corrupt inputs."""
import json

import pytest
import torch

from test_anomaly_online import STATS, Clock, faulty_run, forward_inf, nan_analyze_json
from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.cli import main as cli_main

APPEND = ["run-", "run-~"]  # every run name sorts in between: ranks after the first join the same run


def rank_run(write_config, monkeypatch, rank, module, step):
    """One rank of a two-rank run (the ranks run one after the other, into the same run directory)."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward_inf(model, Clock(model, 1), module, step, 0)
    monitor = TrainerMon(write_config(name=f"rank{rank}.json", **STATS, append_output=APPEND if rank else []))
    monitor.set_monitor(model, optimizer=optimizer)
    run_steps(model, optimizer, 4)
    monitor.stop()
    return monitor.output_dir.parent


def test_earliest_rank_wins(output_dir, write_config, monkeypatch, capsys):
    rank_run(write_config, monkeypatch, 0, "layers.0.mlp.0", step=2)
    run = rank_run(write_config, monkeypatch, 1, "layers.1.mlp.2", step=1)
    report = nan_analyze_json(run, capsys)
    assert report["ranks"] == [0, 1]
    assert {k: report["first"][k] for k in ("rank", "step", "module", "phase")} == \
        {"rank": 1, "step": 1, "module": "layers.1.mlp.2", "phase": "forward"}
    assert report["ties"] == []


def test_same_step_on_two_ranks_is_reported_as_a_tie(output_dir, write_config, monkeypatch, capsys):
    rank_run(write_config, monkeypatch, 0, "layers.0.mlp.0", step=2)
    run = rank_run(write_config, monkeypatch, 1, "layers.1.mlp.2", step=2)
    report = nan_analyze_json(run, capsys)
    assert (report["first"]["rank"], report["first"]["module"]) == (0, "layers.0.mlp.0")
    assert [(t["rank"], t["module"]) for t in report["ties"]] == [(1, "layers.1.mlp.2")]
    assert cli_main(["nan-analyze", str(run)]) == 1
    assert "order across ranks unknown" in capsys.readouterr().out


def test_anomalies_command_lists_top_k_in_key_order(output_dir, write_config, capsys):
    monitor, expected = faulty_run(write_config, "grad_acc_micro_1_only", STATS, steps=4)
    assert cli_main(["anomalies", str(monitor.output_dir.parent), "--top", "3", "--steps", "2-2", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert len(listed) == 3 and listed[0]["first"] and listed[0]["module"] == expected["module"]
    keys = [(r["step"], r["micro_step"], r["call_index"]) for r in listed]
    assert keys == sorted(keys) and {r["step"] for r in listed} == {2}
    assert cli_main(["anomalies", str(monitor.output_dir.parent), "--steps", "0-1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


@pytest.fixture
def finished_run(output_dir, write_config):
    monitor, _ = faulty_run(write_config, "forward_output_inf", {**STATS, "format": ["csv", "db"]})
    return monitor.output_dir


def _fails_naming(capsys, directory, name):
    assert cli_main(["nan-analyze", str(directory)]) == 2
    err = capsys.readouterr().err
    assert name in err, err
    return err


def test_truncated_last_line_is_read_up_to_it_with_a_warning(finished_run, capsys):
    """A last line cut short is what a killed writer leaves: the report is made, and warns naming the file."""
    path = finished_run / "anomalies.jsonl"
    text = path.read_text()
    path.write_text(text[:len(text) - 40])  # a write cut short by a kill
    assert cli_main(["nan-analyze", str(finished_run.parent), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["first"]["module"] == "layers.1.mlp.0"
    assert len(report["warnings"]) == 1 and f"{path}, line " in report["warnings"][0]
    assert cli_main(["nan-analyze", str(finished_run.parent)]) == 1
    assert f"warning: {path}" in capsys.readouterr().out


def test_garbage_in_the_middle_of_anomalies_file_is_named(finished_run, capsys):
    path = finished_run / "anomalies.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2] + ["{not json"] + lines[2:]) + "\n")
    _fails_naming(capsys, finished_run.parent, f"{path}, line 3")


def test_truncated_csv_is_named(finished_run, capsys):
    """The CSV files are read for the steps the database lacks: here, every step (no database)."""
    (finished_run / "monitor.db").unlink()
    path = sorted(finished_run.glob("actv_grad_*.csv"))[0]
    text = path.read_text()
    path.write_text(text[:text.rindex(",")])
    err = _fails_naming(capsys, finished_run.parent, str(path))
    assert "truncated or corrupt" in err


def test_corrupt_database_is_named(finished_run, capsys):
    path = finished_run / "monitor.db"
    for extra in finished_run.glob("monitor.db-*"):
        extra.unlink()
    path.write_bytes(b"this is not a database" * 100)
    _fails_naming(capsys, finished_run.parent, str(path))


def test_corrupt_run_json_is_named(finished_run, capsys):
    """run.json gives CSV rows their pipeline stage and says whether collectives' inputs were recorded."""
    path = finished_run / "run.json"
    path.write_text(path.read_text()[:40])
    _fails_naming(capsys, finished_run.parent, str(path))


def test_missing_or_empty_directory_is_a_clear_error(tmp_path, capsys):
    _fails_naming(capsys, tmp_path / "nope", "no such directory")
    _fails_naming(capsys, tmp_path, "no rank_<R> directories")


def test_report_written_to_file(finished_run, capsys, tmp_path):
    out = tmp_path / "report.json"
    assert cli_main(["nan-analyze", str(finished_run.parent), "--json", "-o", str(out)]) == 1
    assert capsys.readouterr().out == ""
    report = json.loads(out.read_text())
    assert report["sources"] == {"0": ["anomalies.jsonl", "monitor.db", "csv"]}
    assert report["first"]["module"] == "layers.1.mlp.0"


def test_mistyped_anomaly_record_is_named(finished_run, capsys):
    # without the database, whose anomalies table holds the same anomalies, the file is the source read
    (finished_run / "monitor.db").unlink()
    path = finished_run / "anomalies.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    record["step"] = "two"
    path.write_text("\n".join([lines[0], json.dumps(record)] + lines[2:]) + "\n")
    err = _fails_naming(capsys, finished_run.parent, f"{path}, line 2")
    assert "'step'" in err
