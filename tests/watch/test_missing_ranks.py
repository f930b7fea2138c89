"""A run with a rank directory missing: every command says which ranks, on stderr, and works on the others."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from runs import ROOT
from trainmon.read.layout import find_run

COMMANDS = {
    "watch": lambda run, out: ["watch", run, "--once", "--heatmap-every", 1000, "--logdir", out],
    "nan-analyze": lambda run, out: ["nan-analyze", run, "--json", "--quiet"],
    "show": lambda run, out: ["show", run, "--max-rows", 3],
    "export": lambda run, out: ["export", run, out, "--quiet"],
    "plot": lambda run, out: ["plot", run, "--family", "grad_reduced", "-o", out / "grads.png"],
    "overflow": lambda run, out: ["overflow", run],
    "anomalies": lambda run, out: ["anomalies", run, "--quiet"],
}


@pytest.fixture(scope="module")
def gapped_run(finished_run, tmp_path_factory):
    """The 3-rank run without rank_1."""
    run = tmp_path_factory.mktemp("gapped") / "run"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "rank_1")
    return run


@pytest.mark.parametrize("command", COMMANDS)
def test_a_missing_rank_is_named_and_the_others_are_read(gapped_run, tmp_path, command):
    out = tmp_path / "out"
    if command == "plot":
        out.mkdir()
    done = subprocess.run([sys.executable, "-m", "trainmon.cli", *map(str, COMMANDS[command](gapped_run, out))],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    # nan-analyze and overflow say found (1): the run holds an Inf
    assert done.returncode == (1 if command in ("nan-analyze", "overflow") else 0), done.stderr
    warnings = [line for line in done.stderr.splitlines() if "missing (no rank_<R>" in line]
    assert len(warnings) == 1 and "rank(s) 1 of 3 missing" in warnings[0], done.stderr
    if command == "nan-analyze":
        result = json.loads(done.stdout)
        assert result["missing_ranks"] == [1] and result["ranks"] == [0, 2]


def test_the_last_rank_missing_is_found_from_the_world_size(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "rank_2")
    assert find_run(run).missing_ranks == [2]  # run.json records world_size 3
    assert find_run(run / "rank_0").missing_ranks == [], "one rank's directory given on its own lacks nothing"
