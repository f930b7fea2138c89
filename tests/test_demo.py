"""The README's first command: `trainmon demo` trains and writes real output."""
import json
import os
import subprocess
import sys
from pathlib import Path

from process_group import run
from trainmon.demo import DEMO_CONFIG

ROOT = Path(__file__).resolve().parent.parent


def test_configs_demo_json_is_the_embedded_default():
    assert json.loads((ROOT / "configs" / "demo.json").read_text()) == DEMO_CONFIG


def _demo(tmp_path, *args) -> str:
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = run([sys.executable, "-m", "trainmon.cli", "demo", *args], timeout=300, env=env)  # its daemon ends with it
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_trainmon_demo_runs_and_writes_every_family(tmp_path):
    import tempfile
    from trainmon.read import open_run
    config_files = lambda: set(Path(tempfile.gettempdir()).glob("trainmon_demo_*"))  # noqa: E731
    before = config_files()
    stdout = _demo(tmp_path, "--steps", "6")
    assert config_files() == before  # the embedded config's file is gone with the run
    assert "monitor output:" in stdout
    with open_run(next(tmp_path.glob("run-*"))) as run:
        records = run.records()
        assert list(run.scalars("loss").step) == list(range(6))
    for family in ["actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_origin", "param_updated",
                   "exp_avg", "exp_avg_sq"]:
        assert sorted(set(records[records.family == family].step)) == list(range(6)), family


def test_base_install_has_what_the_printed_commands_need():
    import configparser
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    base = config["options"]["install_requires"]
    for package in ("pandas", "tensorboard", "matplotlib"):  # show, the daemon and tensorboard, the heatmaps
        assert package in base, package


def test_demo_inject_nan_names_the_module_and_prints_commands_that_work(tmp_path):
    stdout = _demo(tmp_path, "--steps", "12", "--inject", "nan")
    place = "rank 0 step 6 micro-step 0: layers.1.mlp.0 forward output"
    alert, analysis = stdout.split("trainmon watch alerted", 1)[1].split("trainmon nan-analyze", 1)
    assert place in alert and place in analysis
    commands = [line.split(". ", 1)[1].split("#")[0].strip() for line in stdout.split("next steps:")[1].splitlines()
                if line.strip()[:2] in ("1.", "2.", "3.")]
    assert [c.split()[:2] for c in commands] == [["tensorboard", "--logdir"], ["trainmon", "nan-analyze"],
                                                 ["trainmon", "show"]]
    for command in commands:
        if command.startswith("tensorboard"):
            command += " --inspect"  # reads the event files and prints what TensorBoard would show, no server
        done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=300)
        # nan-analyze's 1: it found the NaN/Inf (0 would be a clean run)
        assert done.returncode == (1 if "nan-analyze" in command else 0), (command, done.stderr[-2000:])
        assert "Traceback" not in done.stderr
        if command.startswith("tensorboard"):
            assert "heatmaps/" in done.stdout and "alerts" in done.stdout and "Overview/loss" in done.stdout
        if "nan-analyze" in command:
            assert place in done.stdout


def test_cli_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "trainmon.cli", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "demo" in out.stdout


def test_the_demos_view_is_smaller_than_its_database(tmp_path):
    """The view's budgets on the demo: a fixed set of tags, and an event file no bigger than the database."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    _demo(tmp_path, "--steps", "40", "--inject", "nan")
    run = next(tmp_path.glob("run-*"))
    events = list((run / "watch").glob("events.out.tfevents.*"))
    tags = {value.tag for path in events for event in EventFileLoader(str(path)).Load()
            for value in event.summary.value}
    assert sum(p.stat().st_size for p in events) <= sum(p.stat().st_size for p in run.glob("rank_*/monitor.db"))
    assert len(tags) < 150 and len([t for t in tags if t.startswith("Overview/")]) <= 30
