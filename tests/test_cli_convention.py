"""One convention across the command line: shared options spelled and parsed alike, every option with help,
one table of exit statuses (0 agree or clean, 1 differ or found, 2 bad input), bad input without a
traceback, and read-side commands that start without torch."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainmon.cli import build_parser, main as cli_main
from trainmon.compare.tensors import compare_tensors

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from generate_run import write_rank  # noqa: E402  (runs written with trainmon's own writers)

RANKS, INF_STEP = 2, 3


def make_run(path: Path, steps: int, inf_step: int = INF_STEP) -> Path:
    """A run of RANKS ranks (66 records a step); an Inf enters rank 0 at `inf_step` (none past the last step)."""
    for rank in range(RANKS):
        write_rank((path, rank, RANKS, steps, 0, inf_step))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {"short": make_run(root / "short", 5), "long": make_run(root / "long", 8),
            "clean": make_run(root / "clean", 4, inf_step=100)}


def _subparsers(parser: argparse.ArgumentParser, path=("trainmon",)):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + (name,), sub
                yield from _subparsers(sub, path + (name,))


def test_every_option_of_every_command_has_help():
    parser = build_parser()
    commands = list(_subparsers(parser))
    assert len(commands) > 15
    missing = [f"{' '.join(path)} {action.option_strings or action.dest}" for path, sub in commands
               for action in sub._actions
               if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
               and not (action.help or "").strip()]
    assert missing == []


def _parse(*argv):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv", [["show", "R"], ["compare", "A", "B"], ["anomalies", "R"], ["overflow", "R"]])
def test_step_ranges_are_spelled_alike_everywhere(argv):
    for text, expected in [("7", (7, 7)), ("10-20", (10, 20)), ("10-", (10, None)), ("-20", (None, 20)),
                           ("10:20", (10, 20))]:  # 10:20: show's earlier spelling
        assert _parse(*argv, "--steps", text).steps == expected


def test_show_keeps_its_earlier_step_option(runs, capsys):
    assert cli_main(["show", str(runs["short"]), "--step", "1:2", "--json"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert cli_main(["show", str(runs["short"]), "--steps", "1-2", "--json"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert old == new and {row["step"] for row in new} == {1, 2} and len(new) == 2 * 66 * RANKS


@pytest.mark.parametrize("argv", [["show", "R"], ["compare", "A", "B"], ["anomalies", "R"], ["overflow", "R"],
                                  ["nan-analyze", "R"], ["export", "R", "O"], ["watch", "R"]])
def test_rank_and_ranks_are_one_option(argv):
    assert _parse(*argv, "--rank", "3", "--rank", "5").ranks == [3, 5]
    assert _parse(*argv, "--ranks", "3", "5").ranks == [3, 5]
    assert _parse(*argv).ranks is None
    with pytest.raises(SystemExit) as exit_:
        _parse(*argv, "--rank", "-1")
    assert exit_.value.code == 2


def test_json_on_the_commands_that_print_a_result(runs, capsys):
    for argv in (["show", str(runs["short"]), "--steps", "4"], ["anomalies", str(runs["short"])],
                 ["nan-analyze", str(runs["short"])], ["overflow", str(runs["short"])],
                 ["compare", str(runs["short"]), str(runs["short"])]):
        cli_main(argv + ["--json"])
        json.loads(capsys.readouterr().out)  # one JSON document


def test_top_zero_is_refused_by_every_command_that_takes_it(capsys):
    for argv in (["anomalies", "R"], ["compare", "A", "B"]):
        with pytest.raises(SystemExit) as exit_:
            _parse(*argv, "--top", "0")
        assert exit_.value.code == 2
        assert "--top" in capsys.readouterr().err


def test_rank_filters_read_only_those_ranks(runs, capsys):
    assert cli_main(["nan-analyze", str(runs["short"]), "--rank", "1", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ranks"] == [1]
    assert cli_main(["anomalies", str(runs["short"]), "--ranks", "1", "--json", "--top", "50"]) == 0
    assert {a["rank"] for a in json.loads(capsys.readouterr().out)} == {1}
    assert cli_main(["nan-analyze", str(runs["short"]), "--rank", "7"]) == 2
    assert "has no rank 7 (ranks: 0, 1)" in capsys.readouterr().err


def test_compare_agrees_only_when_every_record_is_on_both_sides(runs, capsys):
    short, long = str(runs["short"]), str(runs["long"])
    assert cli_main(["compare", short, short, "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["agree"] and same["compared"] == 5 * 66 * RANKS and same["one_side_only"] == 0
    # the long run's 3 later steps exist on one side only: the runs differ, though no common record does
    assert cli_main(["compare", short, long]) == 1
    text = capsys.readouterr().out
    assert f"compared {5 * 66 * RANKS} records both runs hold" in text
    assert f"{3 * 66 * RANKS} exist on one side only" in text
    assert "agree" not in text and "the runs differ" in text
    # within the steps both hold, they agree
    assert cli_main(["compare", short, long, "--steps", "0-4"]) == 0
    assert "the runs agree" in capsys.readouterr().out


def test_compare_refuses_a_step_range_outside_the_runs(runs, capsys):
    assert cli_main(["compare", str(runs["short"]), str(runs["short"]), "--steps", "900-999"]) == 2
    err = capsys.readouterr().err
    assert "holds no step in --steps 900-999 (it holds steps 0-4)" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["overflow", "anomalies"])
def test_a_step_range_outside_the_run_is_bad_input_not_nothing_found(runs, capsys, command):
    assert cli_main([command, str(runs["clean"]), "--steps", "400-500"]) == 2
    err = capsys.readouterr().err
    assert "holds no step in --steps 400-500 (it holds steps 0-3)" in err and "Traceback" not in err
    assert cli_main([command, str(runs["clean"]), "--steps", "2-500"]) == 0  # a range overlapping the run is read


def test_a_run_without_a_record_is_neither_clean_nor_different(tmp_path, capsys):
    empty = make_run(tmp_path / "empty", 0)  # the databases hold no record (a config that collected none)
    for argv in (["nan-analyze", str(empty)], ["overflow", str(empty)], ["compare", str(empty), str(empty)]):
        assert cli_main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert "holds no statistic record" in err and "clean" not in out and "differ" not in out, (argv, out, err)


@pytest.mark.parametrize("command", ["nan-analyze", "overflow"])
def test_a_missing_rank_leaves_a_clean_answer_unknown(runs, tmp_path, capsys, command):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(runs["clean"], run)
    shutil.rmtree(run / "rank_1")
    assert cli_main([command, str(run)]) == 2
    out, err = capsys.readouterr()
    assert "rank(s) 1 of 2 missing" in err and "not known to be clean" in out, (out, err)
    assert cli_main([command, str(run), "--rank", "0"]) == 0  # the rank asked for is there and clean
    assert cli_main(["anomalies", str(run)]) == 0
    assert "rank(s) 1 of 2 missing" in capsys.readouterr().err


def test_exit_statuses_clean_found_and_bad_input(runs, tmp_path, capsys):
    assert cli_main(["nan-analyze", str(runs["clean"])]) == 0
    assert cli_main(["nan-analyze", str(runs["short"])]) == 1
    assert cli_main(["overflow", str(runs["clean"])]) == 0
    assert cli_main(["overflow", str(runs["short"])]) == 1
    assert cli_main(["nan-analyze", str(tmp_path / "missing")]) == 2
    torch.save({"w": torch.ones(3)}, tmp_path / "a.pt")
    torch.save({"w": torch.ones(3) * 2}, tmp_path / "b.pt")
    assert cli_main(["ckpt-compare", str(tmp_path / "a.pt"), str(tmp_path / "a.pt")]) == 0
    assert cli_main(["ckpt-compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]) == 1
    capsys.readouterr()
    assert cli_main(["ckpt-compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["summary"]["differ"] == 1


def test_ckpt_compare_table_shows_a_tensor_that_became_nan(tmp_path, capsys):
    weights = {"ok": torch.ones(4), "gone": torch.arange(1.0, 5.0)}
    torch.save(weights, tmp_path / "a.pt")
    torch.save({**weights, "gone": torch.full((4,), float("nan"))}, tmp_path / "b.pt")
    assert cli_main(["ckpt-compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]) == 1
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("parameter"))
    row = next(line for line in lines if line.startswith("gone")).split()
    assert "nonfinite≠" in header
    assert row[1:5] == ["nan", "nan", "nan", "4"]  # l2, cosine, max|diff|, the 4 elements NaN in B only


def test_a_cosine_stays_within_minus_one_and_one():
    for seed in range(50):
        x = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
        assert -1.0 <= compare_tensors(x, x, 0.0, 0.0)["cosine"] <= 1.0
        assert -1.0 <= compare_tensors(x, -x, 0.0, 0.0)["cosine"] <= 1.0


@pytest.mark.parametrize("content, expect", [(None, "config file not found"), ("{bad", "invalid JSON at line 1"),
                                             ('{"ops": []}', '"ops": ["norm"]')])
def test_demo_with_a_bad_config_says_so_without_a_traceback(tmp_path, capsys, content, expect):
    config = tmp_path / "config.json"
    if content is not None:
        config.write_text(content)
    assert cli_main(["demo", "--config", str(config), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trainmon demo: {config}") and expect in err and "Traceback" not in err


def test_anomalies_on_a_clean_run_says_what_looked(runs, capsys):
    assert cli_main(["anomalies", str(runs["clean"])]) == 0
    assert capsys.readouterr().out.strip() == "no anomalies: alert.rules (AnomalyNan) found none"


def test_anomalies_jsonl_is_not_read_when_the_database_holds_its_lines(runs, tmp_path, capsys):
    """The table and the file hold the same anomalies: the file is read only when they differ in count."""
    run = tmp_path / "run"
    make_run(run, 5)
    assert cli_main(["nan-analyze", str(run), "--json"]) == 1
    whole = json.loads(capsys.readouterr().out)
    jsonl = run / "rank_1" / "anomalies.jsonl"
    lines = jsonl.read_text().splitlines(keepends=True)
    jsonl.write_text("".join(lines[:-1]) + "not json\n")  # same count: not read, same answer
    assert cli_main(["nan-analyze", str(run), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["first"] == whole["first"]
    jsonl.write_text("".join(lines) + "not json\n")  # one line more: read, and its bad line named
    assert cli_main(["nan-analyze", str(run)]) == 2
    assert f"{jsonl}, line {len(lines) + 1}" in capsys.readouterr().err


# A command's start, in a fresh interpreter: torch must not be imported (it costs seconds of CPU).
_WITHOUT_TORCH = """
import sys
from trainmon.cli import main
try:
    main(sys.argv[1:])
finally:  # --help ends in SystemExit
    assert "torch" not in sys.modules, "torch was imported"
"""


@pytest.mark.parametrize("command", ["--help", "nan-analyze", "anomalies", "show", "compare", "export", "overflow"])
def test_read_side_commands_start_without_torch(runs, tmp_path, command):
    run = str(runs["short"])
    argv = {"--help": ["--help"], "nan-analyze": ["nan-analyze", run, "--quiet"],
            "anomalies": ["anomalies", run, "--quiet"], "show": ["show", run, "--steps", "1"],
            "compare": ["compare", run, run, "--steps", "1"], "overflow": ["overflow", run],
            "export": ["export", run, str(tmp_path / "out"), "--quiet"]}[command]
    if command == "export":
        pytest.importorskip("pyarrow")
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "torch was imported" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_bare_trainmon_prints_its_usage_and_exits_2(capsys):
    assert cli_main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: trainmon") and "nan-analyze" in err


@pytest.mark.parametrize("command, operands", [("show", ["RUN"]), ("config-check compare", ["A", "B"])])
def test_an_unknown_option_gets_the_usage_of_its_command(capsys, command, operands):
    with pytest.raises(SystemExit) as stop:
        cli_main(command.split() + operands + ["--bogus"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"usage: trainmon {command} ") and \
        f"trainmon {command}: error: unrecognized arguments: --bogus" in err, err


def test_a_figure_the_run_lacks_is_answered_with_the_ones_it_has(runs, tmp_path, capsys):
    from trainmon.read import open_run
    with open_run(runs["clean"]) as run:
        ops = run.ops(0)
    assert cli_main(["show", str(runs["clean"]), "--ops", "norm,foo"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--ops takes: {', '.join(ops)}")
    assert cli_main(["plot", str(runs["clean"]), "--family", "actv", "--op", "foo", "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--op takes: {', '.join(sorted(ops))}")
