"""The daemon over every cadence key: steps without records (between `step_interval` steps, before `start_step`,
after `collect_times`) are skipped, with and without the NaN sentinel, whether the daemon reads a finished run in
chunks or a live one a step at a time."""
import pytest
import torch

from runs import read_events
from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.read import open_run
from trainmon.watch import run_watcher
from trainmon.watch.run_watcher import RunWatcher, WatchOptions

STEPS = 24
CADENCES = {
    "step_interval": {"step_interval": 5},
    "sparse_step_interval": {"step_interval": 20},  # a chunk of 16 steps without records
    "start_step": {"start_step": 18},
    "collect_times": {"collect_times": 3, "step_interval": 2},
    "collect_times_0": {"collect_times": 0},
    "step_count_per_record": {"step_count_per_record": 3, "step_interval": 3, "format": ["csv"]},  # files of 3
}


def _train(write_config, config: dict) -> str:
    path = write_config(**{"all_xy": True, "xy_distribution": True, "wg_distribution": True,
                           "ops": ["min", "max", "norm", "nans", "infs"], "format": ["db"], **config})
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = TrainerMon(path)
    monitor.set_monitor(model, optimizer=optimizer)
    run_steps(model, optimizer, STEPS, on_step=lambda step: monitor.log_scalar("loss", float(step)))
    monitor.stop()
    return monitor.output_dir.parent


def _export(run, logdir, draw: bool) -> dict:
    """What `watch --once` does; `draw`: the heatmaps too (seconds: matplotlib in a worker process)."""
    watcher = RunWatcher(run, logdir, WatchOptions(once=True, heatmap_every=1000))
    watcher.poll(final=True)
    watcher.finish(draw=draw)
    return read_events(logdir)[0]


@pytest.mark.parametrize("sentinel", [False, True], ids=["", "sentinel"])
@pytest.mark.parametrize("cadence", CADENCES.values(), ids=CADENCES.keys())
def test_the_daemon_exports_the_collected_steps_of_every_cadence(output_dir, write_config, tmp_path, monkeypatch,
                                                                 cadence, sentinel):
    run = _train(write_config, {**cadence, "sentinel": sentinel})
    with open_run(run) as opened:
        collected = sorted(set(opened.records().step))
    csv = cadence.get("format") == ["csv"]
    for chunk_steps in (run_watcher.CHUNK_STEPS, 1):  # 1: each step read alone, as a live daemon reads them
        monkeypatch.setattr(run_watcher, "CHUNK_STEPS", chunk_steps)
        scalars = _export(run, tmp_path / f"view_{chunk_steps}", draw=False)
        loss = [step for step, _ in scalars.get("Overview/loss", [])]
        assert loss == ([] if csv else list(range(STEPS)))  # CSV files hold no scalars
        # the records' charts, and the NaN/Inf counts (no 0 where nothing was read), at the collected steps only
        for tag in ("Worst tensor/actv norm", "Overview/nan_elements", "actv/nan_elements"):
            assert [step for step, _ in scalars.get(tag, [])] == collected, (chunk_steps, tag)


def test_the_heatmaps_of_a_run_collected_every_fifth_step(output_dir, write_config, tmp_path):
    run = _train(write_config, {"step_interval": 5, "sentinel": True})
    scalars = _export(run, tmp_path / "view", draw=True)
    assert [step for step, _ in scalars["Worst tensor/actv norm"]] == [0, 5, 10, 15, 20]
    drawn = {path.stem for path in (tmp_path / "view" / "heatmaps").glob("*.png")}
    assert {"actv_layer_x_step", "loss_rank_x_step"} <= drawn, drawn


def test_plot_of_a_run_that_collected_nothing(output_dir, write_config, tmp_path, capsys):
    from trainmon.cli import main
    run = _train(write_config, {"collect_times": 0})
    assert main(["plot", str(run), "--family", "loss", "-o", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert main(["plot", str(run), "--family", "actv", "-o", str(tmp_path / "actv.png")]) == 2
    assert "no 'actv'" in capsys.readouterr().err
