"""benchmarks/README.md is the guide to the benchmarks: every script has an entry, every command it gives parses with
that script's own options, every row of its current-figures table says when, on which code and machine, and by
which command it was measured, and every round in benchmarks/results/ is named by its date and topic."""
import argparse
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
README = BENCHMARKS / "README.md"
COMMAND = re.compile(r"python3? benchmarks/(\w+)\.py([^`\n]*)")
TABLE_COLUMNS = ["measure", "figure", "date", "commit", "machine", "command"]


def readme_commands() -> list[tuple[str, list[str]]]:
    """(script, argv) of every `python benchmarks/<script>.py ...` the guide gives, in code blocks and tables."""
    return [(script, shlex.split(args, comments=True)) for script, args in COMMAND.findall(README.read_text())]


def figure_rows() -> list[dict]:
    """The rows of the current-figures table, by column."""
    text = README.read_text()
    assert "\n## Current figures\n" in text, "benchmarks/README.md has no current-figures table"
    section = text.split("\n## Current figures\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split(" | ")]
    assert header == TABLE_COLUMNS
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]
    assert all(len(row) == len(header) for row in rows), [row for row in rows if len(row) != len(header)]
    return [dict(zip(header, row)) for row in rows]


class Parsed(Exception):
    """Raised in place of running a benchmark once its arguments have parsed."""


def parse_only(script: str, argv: list[str], monkeypatch) -> None:
    """Runs `script`'s main() with `argv` up to its argument parsing: argparse's exit if they do not parse."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))   # the scripts import each other as they do when run
    spec = importlib.util.spec_from_file_location(f"benchmark_{script}", BENCHMARKS / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        parse_args(parser, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(Parsed):
        module.main()


@pytest.mark.parametrize("script", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_every_script_has_an_entry(script):
    assert f"#### `{script}.py`" in README.read_text(), f"benchmarks/{script}.py has no entry in benchmarks/README.md"


@pytest.mark.parametrize("script, argv", readme_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_command_parses(script, argv, monkeypatch, capsys):
    assert (BENCHMARKS / f"{script}.py").exists(), f"benchmarks/README.md names a missing benchmarks/{script}.py"
    try:
        parse_only(script, argv, monkeypatch)
    except SystemExit as stop:
        pytest.fail(f"benchmarks/{script}.py {shlex.join(argv)}: exit {stop.code}: {capsys.readouterr().err}")


def test_a_command_with_an_unknown_option_is_caught(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse_only("launches", ["--tiers", "full", "--no-such-option"], monkeypatch)
    assert "--no-such-option" in capsys.readouterr().err


def test_every_figure_says_when_on_what_and_how_it_was_measured():
    rows = figure_rows()
    assert rows
    for row in rows:
        measured = re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"])
        assert measured or (row["date"] == "—" and "to be measured" in row["figure"]), row
        assert re.fullmatch(r"`[0-9a-f]{7,40}`", row["commit"]), row
        assert row["machine"] and "`" in row["command"], row


def test_every_round_of_results_is_named_by_date_and_topic():
    for path in (BENCHMARKS / "results").iterdir():
        assert path.name == "README.md" or re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", path.name), path
