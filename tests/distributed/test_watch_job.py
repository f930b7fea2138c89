"""`trainmon watch` beside a real 2-rank DDP job (gloo) that writes only `db`: the daemon, spawned by rank 0
from the `watch` key, exports cross-rank figures equal to the ranks' databases, draws the heatmaps, and
alerts on an Inf injected on rank 1 while the job is still running, naming what nan-analyze names."""
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest

from launch import torchrun
from verify import nan_analyze, the_run

from trainmon.read import open_run

STEPS, INJECT_STEP = 30, 12
PNG_SIZE = (1000, 600)


def _wait_gone(pid: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError(f"trainmon watch (pid {pid}) did not exit once the job had finished")


def _expected(run: str) -> dict:
    """{(layer tag, step): value}: per family and layer, the largest norm of its tensors over ranks and
    micro-steps (NaN if one is NaN; +Inf written as NaN, which TensorBoard draws), from the databases."""
    from trainmon.watch.view import ViewOptions
    options = ViewOptions()
    with open_run(run, "db") as monitor_run:
        frame = monitor_run.records()
    frame = frame[frame.family != "comm"]
    frame = frame.assign(layer=[options.layer(f, n, v) for f, n, v in zip(frame.family, frame.name, frame.vpp_stage)])
    out = {}
    for (family, layer, step), group in frame.groupby(["family", "layer", "step"]):
        values = group["norm"].to_numpy()
        out[(f"{family}/norm of {layer}", step)] = values.max() if np.isfinite(values).all() else math.nan
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("watch_job")
    output_dir = tmp / "monitor_output"
    torchrun("job_watch.py", 2, ["--out", str(tmp), "--inject", f"1:{INJECT_STEP}", "--steps", str(STEPS)],
             output_dir)
    _wait_gone(int((tmp / "watch_pid").read_text()))
    return tmp, the_run(output_dir)


def test_alert_names_rank_1_while_the_job_runs_and_matches_nan_analyze(job):
    tmp, run = job
    seen = json.loads((tmp / "alert_seen.json").read_text())
    assert seen["first_seen_at_step"] < STEPS - 1, "the alert came while the job was still running"
    first = seen["latest"]["first"]
    assert (first["rank"], first["step"], first["module"], first["phase"]) == (1, INJECT_STEP, "blocks.0", "forward")
    alerts = [json.loads(line) for line in (Path(run) / "watch" / "alerts.jsonl").read_text().splitlines()]
    assert alerts[0]["type"] == "first"
    assert all(a["type"] == "refinement" and a["refines"] == a["alert"] - 1 for a in alerts[1:])
    assert alerts[-1]["first"] == nan_analyze(run)["first"]


def test_tensorboard_holds_the_cross_rank_figures_of_the_databases(job):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _, run = job
    events = EventAccumulator(str(Path(run) / "watch" / "max"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = _expected(run)
    assert len(expected) > 100
    for (tag, step), want in expected.items():
        got = {e.step: e.value for e in events.Scalars(tag)}
        assert step in got, f"{tag} step {step}"
        if math.isfinite(want):
            assert got[step] == pytest.approx(want, rel=1e-6, abs=1e-30), (tag, step)
        else:
            assert got[step] == want or (math.isnan(got[step]) and math.isnan(want)), (tag, step)
    steps = {e.step for e in events.Scalars("Overview/loss")}
    assert steps == set(range(STEPS)), "the loss at every step, NaN kept"
    assert math.isnan(events.Scalars("Overview/loss")[-1].value)
    assert {e.step for e in events.Scalars("scalars/loss/median")} == set(range(STEPS))  # the spread over 2 ranks
    assert len([t for t in tags if not t.startswith("detail/")]) < 200, "no tag per tensor, rank or call"
    assert {t for t in tags if t.startswith("detail/")} >= {"detail/actv/head.output/norm_median", "detail/actv/head.output/norm_max"}, \
        "the config's watch.detail reaches the spawned daemon"
    assert "actv/norm of blocks.0" in tags and "grad_reduced/norm of head" in tags
    # the text plugin holds the alert, the custom-scalars plugin the layout
    assert "alerts" in events.Tags()["tensors"] and "custom_scalars__config__" in events.Tags()["tensors"]
    # the headline stays on the incident: rank 1's blocks.0 at the injected step, written once, its rank charted after
    [incident] = events.Tensors("Overview/first_nonfinite")
    text = incident.tensor_proto.string_val[0].decode()
    assert incident.step == INJECT_STEP and "**blocks.0**" in text and "on rank 1" in text, text
    assert [(e.step, e.value) for e in events.Scalars("Overview/first_nonfinite_rank in blocks.0 (actv)")] == \
        [(step, 1.0) for step in range(INJECT_STEP, STEPS)]
    images = events.Tags()["images"]
    for name in ("heatmaps/actv_layer_x_step", "heatmaps/actv_layer_x_rank", "heatmaps/loss_rank_x_step",
                 "heatmaps/grad_norm_rank_x_step"):
        assert name in images
        last = events.Images(name)[-1]
        assert (last.width, last.height) == PNG_SIZE and last.step == STEPS - 1


def test_heatmap_pngs_have_the_expected_size(job):
    from PIL import Image
    _, run = job
    folder = Path(run) / "watch" / "heatmaps"
    names = {p.stem for p in folder.glob("*.png")}
    for family in ("actv", "grad_reduced", "param_origin", "exp_avg"):
        assert {f"{family}_layer_x_step", f"{family}_layer_x_rank"} <= names
    assert {"loss_rank_x_step", "grad_norm_rank_x_step"} <= names
    for path in folder.glob("*.png"):
        with Image.open(path) as image:
            assert image.size == PNG_SIZE, path
    assert not any((Path(run) / f"rank_{r}" / "watch").exists() for r in (0, 1)), "nothing in rank directories"
