"""The README's first command: `trainmon demo` trains and writes real output."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow  # the demo as a process of its own
def test_trainmon_demo_runs_and_writes_every_family(tmp_path):
    import tempfile
    from trainmon.read import open_run
    config_files = lambda: set(Path(tempfile.gettempdir()).glob("trainmon_demo_*"))  # noqa: E731
    before = config_files()
    stdout = _demo(tmp_path, "--steps", "6")
    assert config_files() == before  # the embedded config's file is gone with the run
    assert "monitor output:" in stdout
    run_dir = next(tmp_path.glob("run-*"))
    with open_run(run_dir) as run:
        records = run.records()
        assert list(run.scalars("loss").step) == list(range(6)) == list(run.scalars("lr").step)
    # the module tree in model order with its classes, for the structure view
    struct = json.loads((run_dir / "rank_0" / "module_struct.json").read_text())
    assert list(struct)[:3] == ["0:", "0:embed", "0:pos"] and struct["0:layers.1.mlp"]["class"] == "Sequential"
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


@pytest.mark.slow  # the demo as a process of its own
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


@pytest.mark.slow  # the demo as a process of its own
def test_the_demos_view_is_smaller_than_its_database(tmp_path):
    """The view's budgets on the demo: a fixed set of tags, and an event file no bigger than the database."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    _demo(tmp_path, "--steps", "40", "--inject", "nan")
    run = next(tmp_path.glob("run-*"))
    events = list((run / "watch").rglob("events.out.tfevents.*"))  # every run of the view
    values = [value for path in events for event in EventFileLoader(str(path)).Load() for value in event.summary.value]
    tags = {value.tag for value in values}
    assert sum(p.stat().st_size for p in events) <= sum(p.stat().st_size for p in run.glob("rank_*/monitor.db"))
    assert len(tags) < 150
    charts = {value.tag for value in values if value.metadata.plugin_data.plugin_name == "scalars"
              and value.tag.startswith("Overview/")}
    assert "Overview/loss" in charts and len(charts) <= 12, charts  # the first page of TensorBoard's first group


def _hints(tmp_path, monkeypatch, config: dict, steps: int = 12) -> list[tuple[str, str]]:
    """The demo's next steps after a small training under `config`."""
    from trainmon import demo
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    _, monitor = demo.train(steps, str(path), batch=2, seq=8, hidden=16, layers=1, log_every=0)
    run_dir = monitor.output_dir.parent
    return demo.next_steps(run_dir, demo.watch_logdir(run_dir, monitor.config.watch),
                           monitor.watch_process is not None)


def _trainmon(command: str, capsys) -> str:
    """A printed `trainmon ...` command run in this process: its stdout (it must exit 0)."""
    import shlex
    from trainmon.cli import main
    capsys.readouterr()
    assert main(shlex.split(command)[1:]) == 0, command
    return capsys.readouterr().out


def test_the_next_steps_follow_the_config(tmp_path, monkeypatch, capsys):
    """Without `watch` the first step makes the view; `show` is given a step that was collected (not the last one,
    with step_interval 5 over 12 steps), and every command works."""
    hints = _hints(tmp_path, monkeypatch, {"format": ["db"], "wg_distribution": True, "step_interval": 5})
    commands = [command for command, _ in hints]
    run_dir = str(next((tmp_path / "out").glob("run-*")))
    assert commands == [f"trainmon watch {run_dir} --once", f"tensorboard --logdir {run_dir}/watch",
                        f"trainmon nan-analyze {run_dir}",
                        f"trainmon show {run_dir} --family grad_reduced --steps 10"]
    _trainmon(commands[0], capsys)
    assert list((tmp_path / "out").glob("run-*/watch/max/events.out.tfevents.*"))
    _trainmon(commands[2], capsys)
    rows = json.loads(_trainmon(commands[3] + " --json", capsys))
    assert rows and {row["step"] for row in rows} == {10}


def test_the_next_steps_of_a_run_that_collected_nothing(tmp_path, monkeypatch, capsys):
    hints = _hints(tmp_path, monkeypatch, {"format": ["db"], "wg_distribution": True, "collect_times": 0})
    command, note = hints[-1]
    assert command.endswith("--scalars") and "no step was collected" in note
    assert "loss" in _trainmon(command, capsys)


def test_the_next_steps_of_a_run_without_readable_output(tmp_path, monkeypatch):
    hints = _hints(tmp_path, monkeypatch, {"format": ["tensorboard"], "wg_distribution": True})
    run_dir = next((tmp_path / "out").glob("run-*"))
    assert [command for command, _ in hints] == [f"tensorboard --logdir {run_dir}"]


@pytest.mark.slow
def test_demo_with_a_config_collecting_every_fifth_step(tmp_path):
    """The daemon beside the job follows a run with steps between collected ones to its end, and the hints name a
    collected step."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    config = tmp_path / "every_fifth.json"
    config.write_text(json.dumps({**DEMO_CONFIG, "step_interval": 5}))
    stdout = _demo(tmp_path, "--config", str(config), "--steps", "12")
    assert "trainmon watch exited" not in stdout and "still running" not in stdout, stdout
    run = next(tmp_path.glob("run-*"))
    steps: dict = {}
    for path in (run / "watch" / "max").glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(event.step)
    assert steps["Overview/loss"] == list(range(12)) and steps["Worst tensor/actv norm"] == [0, 5, 10]
    assert f"trainmon show {run} --family grad_reduced --steps 10 " in stdout


def test_the_readmes_training_script_logs_the_loss_with_a_real_method():
    """The snippet a user copies gives their view a loss chart, through methods TrainerMon has."""
    import re
    from trainmon import TrainerMon
    readme = (ROOT / "README.md").read_text()
    snippet = readme.split("## Enabling it in a training script", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    assert 'monitor.log_scalar("loss", loss)' in snippet
    for method in re.findall(r"monitor\.(\w+)\(", snippet):
        assert callable(getattr(TrainerMon, method, None)), method


def test_every_package_data_pattern_names_files():
    import configparser
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    for package, patterns in config["options.package_data"].items():
        for pattern in patterns.replace(",", " ").split():
            assert list((ROOT / package).glob(pattern)), f"{package}: {pattern}"
