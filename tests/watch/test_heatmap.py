"""Heatmaps a person can read at scale: a row per layer (the worst of its tensors), every row labelled and
the picture growing with them, ranks in buckets above 64, NaN and +Inf in their colours at their cell, the
first incident circled in its layer and bucket, and the PNG files equal to the TensorBoard images."""
import io
import math

import numpy as np
import pytest

from runs import read_events, watch_once
from synthetic import history
from test_watch_plot import plot
from trainmon.watch.canvas import (BOTTOM, MAX_ROWS, MIN_HEIGHT, MISSING_RGB, NAN_RGB, NEG_INF_RGB, POS_INF_RGB,
                                   ROW_PX, TOP)
from trainmon.watch.grid import MAX_RANKS, MAX_STEPS, buckets, layers, reduce
from trainmon.watch.heatmap import pictures
from trainmon.watch.view import MAX_RUN

from conftest import INF_STEP, STEPS as RUN_STEPS

LAYERS, TENSORS, RANKS, STEPS = 120, 3, 1000, 30
NAN, INF, BAD_RANK = (7, 5), (50, STEPS - 1), 517  # (layer, step); the Inf at the latest step (layer x rank)
FIRST = {"rank": BAD_RANK, "step": NAN[1], "module": "layers.7.mlp.2", "phase": "forward", "tensor": "output"}
LAYER_LABELS = ["embed"] + [f"layers.{i}" for i in range(LAYERS)]


def _image(png: bytes) -> np.ndarray:
    from PIL import Image
    with Image.open(io.BytesIO(png)) as image:
        return np.asarray(image.convert("RGB"))


def _centre(picture, row: int, column: int, columns: int) -> tuple[int, int]:
    """(y, x) pixel of a cell's centre."""
    left, top, right, bottom = picture.area
    return (int(top + (row + 0.5) * (bottom - top) / len(picture.rows)),
            int(left + (column + 0.5) * (right - left) / columns))


def _colour(picture, row: int, column: int, columns: int) -> tuple[int, ...]:
    return tuple(_image(picture.png)[_centre(picture, row, column, columns)])


def _is(pixel: tuple[int, ...], colour: tuple[float, float, float]) -> bool:
    return all(abs(int(p) - 255 * c) <= 1 for p, c in zip(pixel, colour))


def _finite(pixel: tuple[int, ...]) -> bool:
    """Coloured as a finite value: none of the colours of NaN, ±Inf and no record."""
    return not any(_is(pixel, colour) for colour in (NAN_RGB, POS_INF_RGB, NEG_INF_RGB, MISSING_RGB))


def _circled(picture, row: int, column: int, columns: int) -> bool:
    """Whether the circle's black ring passes within 12 pixels of the cell's centre (no cell colour is black)."""
    y, x = _centre(picture, row, column, columns)
    around = _image(picture.png)[y - 12:y + 13, x - 12:x + 13]
    return bool((around.max(axis=2) < 40).any())


@pytest.fixture(scope="module")
def big():
    window = history(LAYERS, TENSORS, RANKS, STEPS, NAN, INF, BAD_RANK)
    return window, {p.name: p for p in pictures(window, FIRST)}


def test_layers_reduce_their_tensors_nan_over_inf_over_max():
    tensors = [("embed.out", 0), ("layers.1.a", 0), ("layers.10.a", 0), ("layers.1.b", 0), ("layers.10.b", 0),
               ("layers.1.a", 1)]
    axis = layers(tensors)
    assert axis.labels == ["embed", "layers.1", "layers.10", "1:layers.1"]  # model order, vpp prefix kept
    values = np.array([[1.0, 1.0, 1.0, -5.0], [2.0, math.inf, math.nan, 3.0], [3.0, 1.0, math.inf, 3.0],
                       [4.0, math.nan, 1.0, 3.0], [0.5, 1.0, 1.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    missing = np.zeros(values.shape, dtype=bool)
    missing[1:4:2, 3] = True  # layers.1 has no record at the last step
    got, empty = reduce(values, missing, axis, 0, magnitude=False)
    np.testing.assert_array_equal(got[1], [4.0, math.nan, math.nan, math.nan])  # NaN wins over +Inf
    np.testing.assert_array_equal(got[2], [3.0, 1.0, math.inf, 3.0])
    assert empty.tolist() == [[False] * 4, [False, False, False, True], [False] * 4, [False] * 4]
    worst, _ = reduce(values[:1], missing[:1], buckets([0, 1, 2, 3], 2, "r"), 1, magnitude=True)
    np.testing.assert_array_equal(worst, [[1.0, -5.0]])  # the largest |value| of its bucket


def test_ranks_are_bucketed_contiguously_above_64():
    axis = buckets(list(range(RANKS)), MAX_RANKS, "r")
    assert len(axis.labels) <= MAX_RANKS and axis.labels[:2] == ["r0-15", "r16-31"] and axis.labels[-1] == "r992-999"
    assert axis.labels[axis.holding(BAD_RANK)] == "r512-527"
    assert buckets([0, 4, 8], MAX_RANKS, "r").labels == ["0", "4", "8"]  # few ranks: one each, as they are


def test_a_nan_at_one_step_of_a_long_window_is_not_lost():
    window = history(2, 1, 1, 600, (1, 333), (0, 10), 0)  # 600 steps: buckets of 3 (at most 250 columns)
    picture = pictures(window, families=["actv"])[0]
    columns = len(buckets(list(range(600)), MAX_STEPS).labels)
    assert columns <= MAX_STEPS and _is(_colour(picture, 2, 333 // 3, columns), NAN_RGB)
    assert _is(_colour(picture, 1, 10 // 3, columns), POS_INF_RGB) and _finite(_colour(picture, 2, 332 // 3 - 1, columns))


def test_a_row_per_layer_each_labelled_nan_and_inf_in_their_cells(big):
    _, drawn = big
    assert set(drawn) == {"actv_layer_x_step", "actv_layer_x_rank", "loss_rank_x_step"}  # no tensor pictures
    picture = drawn["actv_layer_x_step"]
    assert list(picture.rows) == LAYER_LABELS  # one row per layer, in model order, every one labelled
    assert _image(picture.png).shape[:2] == (picture.height, picture.width)
    nan_row, inf_row = 1 + NAN[0], 1 + INF[0]
    assert _is(_colour(picture, nan_row, NAN[1], STEPS), NAN_RGB)
    assert _is(_colour(picture, inf_row, INF[1], STEPS), POS_INF_RGB)
    assert _finite(_colour(picture, nan_row, NAN[1] + 1, STEPS))
    # (away from the frame of the cells, black too)
    assert _circled(picture, nan_row, NAN[1], STEPS) and not _circled(picture, inf_row, STEPS // 2, STEPS)


def test_ranks_in_buckets_the_bad_one_coloured_and_circled(big):
    _, drawn = big
    columns = len(buckets(list(range(RANKS)), MAX_RANKS).labels)
    at_last = drawn["actv_layer_x_rank"]  # the latest step: the Inf on rank 517 of layers.50
    assert list(at_last.rows) == LAYER_LABELS
    assert _is(_colour(at_last, 1 + INF[0], BAD_RANK // 16, columns), POS_INF_RGB)
    assert _finite(_colour(at_last, 1 + INF[0], BAD_RANK // 16 + 1, columns))
    loss = drawn["loss_rank_x_step"]
    assert list(loss.rows) == buckets(list(range(RANKS)), MAX_RANKS, "r").labels
    assert _is(_colour(loss, BAD_RANK // 16, NAN[1], STEPS), NAN_RGB)
    assert _circled(loss, BAD_RANK // 16, NAN[1], STEPS)


def test_after_an_incident_the_layer_x_rank_picture_stays_at_its_step_circled():
    """The NaN at step 5 is the incident: the picture per rank is drawn at its step, not at the latest one (where an
    Inf is too, and every later step may be all NaN)."""
    window = history(LAYERS, TENSORS, RANKS, STEPS, NAN, INF, BAD_RANK, places=True)
    picture = next(p for p in pictures(window, FIRST) if p.name == "actv_layer_x_rank")
    columns = len(buckets(list(range(RANKS)), MAX_RANKS).labels)
    assert _is(_colour(picture, 1 + NAN[0], BAD_RANK // 16, columns), NAN_RGB)
    assert _circled(picture, 1 + NAN[0], BAD_RANK // 16, columns)
    assert _finite(_colour(picture, 1 + INF[0], BAD_RANK // 16, columns))  # the latest step's Inf is not drawn


def test_the_picture_grows_with_its_rows(big):
    _, drawn = big
    small = pictures(history(4, TENSORS, 1, STEPS, (3, 3), (3, 7), 0))[0]
    tall = drawn["actv_layer_x_step"]
    assert small.name == "actv_layer_x_step" and list(small.rows) == ["embed"] + [f"layers.{i}" for i in range(4)]
    assert _image(small.png).shape[:2] == (small.height, small.width) == (MIN_HEIGHT, 1000)
    assert tall.height == TOP + BOTTOM + ROW_PX * len(LAYER_LABELS) > small.height


def test_the_layer_of_the_module_is_circled_not_a_prefix_of_it():
    # activation grads come last layer first: layers.10 before layers.1
    window = history(12, 2, 1, 10, (1, 4), (10, 4), 0, backward=True)
    first = {**FIRST, "rank": 0, "step": 4, "module": "layers.1"}
    picture = pictures(window, first, families=["actv"])[0]
    rows = list(picture.rows)
    assert rows[:3] == ["embed", "layers.11", "layers.10"]
    assert _circled(picture, rows.index("layers.1"), 4, 10)
    assert not _circled(picture, rows.index("layers.10"), 4, 10)


@pytest.mark.slow
def test_tensor_rows_on_request_split_into_parts(big):
    window, _ = big
    drawn = pictures(window, FIRST, families=["actv"], rows="tensor")
    names = [p.name for p in drawn]
    assert names == ["actv_tensor_x_step_part1of2", "actv_tensor_x_step_part2of2", "actv_tensor_x_rank_part1of2",
                     "actv_tensor_x_rank_part2of2"]
    first, second = drawn[:2]
    assert list(first.rows) + list(second.rows) == list(window.rows["actv"])  # every tensor, each labelled
    assert all(len(p.rows) <= MAX_ROWS and _image(p.png).shape[:2] == (p.height, p.width) for p in drawn)
    row = list(first.rows).index("layers.7.mlp.2.output")
    assert _is(_colour(first, row, NAN[1], STEPS), NAN_RGB) and _circled(first, row, NAN[1], STEPS)


def _images(logdir) -> dict[str, tuple[bytes, int, int]]:
    """{tag: (PNG, height, width)} of the last image of each tag in the daemon's event files."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    out = {}
    for path in sorted((logdir / MAX_RUN).glob("events.out.tfevents.*")):
        for record in RawEventFileLoader(str(path)).Load():
            for value in Event.FromString(record).summary.value:
                if value.HasField("image"):
                    out[value.tag] = (value.image.encoded_image_string, value.image.height, value.image.width)
    return out


@pytest.mark.slow
def test_watch_and_plot_write_the_tensorboard_images(finished_run, tmp_path):
    logdir = tmp_path / "w"
    done = watch_once(finished_run, "--logdir", logdir)
    assert done.returncode == 0, done.stderr
    files = {f"heatmaps/{p.stem}": p.read_bytes() for p in (logdir / "heatmaps").glob("*.png")}
    images = _images(logdir)
    assert set(files) == set(images) and "heatmaps/actv_layer_x_step" in files and "heatmaps/actv_layer_x_rank" in files
    for tag, (png, height, width) in images.items():
        assert files[tag] == png, tag
        assert _image(png).shape[:2] == (height, width), tag
    assert read_events(logdir)[1]["heatmaps/actv_layer_x_step"] == [RUN_STEPS - 1]
    out = tmp_path / "actv.png"
    done = plot(finished_run, "--family", "actv", "-o", out)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == files["heatmaps/actv_layer_x_step"]  # the daemon's picture
    drawn = pictures_of_run(finished_run)
    assert drawn.png == out.read_bytes() and list(drawn.rows) == [f"layers.{i}" for i in range(8)]
    # the Inf enters rank 1's layers.3 at INF_STEP: circled there (the run's norm is of the finite elements)
    assert _circled(drawn, 3, INF_STEP, RUN_STEPS) and not _circled(drawn, 5, INF_STEP, RUN_STEPS)
    done = plot(finished_run, "--family", "actv", "--rows", "tensor", "--columns", "rank", "-o", tmp_path / "t.png")
    assert done.returncode == 0 and (tmp_path / "t.png").exists(), done.stderr


def pictures_of_run(run):
    """The actv layer x step picture of a finished run, drawn here (as `trainmon plot` does)."""
    from trainmon.analysis.nan_analyze import analyze
    from trainmon.read.layout import find_run
    from trainmon.watch.follow import RankFollower
    from trainmon.watch.history import History
    from trainmon.watch.run_watcher import read_figures
    followers = [RankFollower(rank_dir) for rank_dir in find_run(run).ranks]
    for follower in followers:
        follower.poll(final=True)
    window = History()
    for step, figures in sorted(read_figures(followers, 0, RUN_STEPS - 1).items()):
        window.add(figures)
    return pictures(window, analyze(run)["first"], families=["actv"])[0]


@pytest.mark.slow
def test_the_daemon_keeps_the_incidents_step_for_the_layer_x_rank_pictures(tmp_path):
    """Read by worker processes (8 ranks, --once), in chunks: the step of the incident keeps every rank's values."""
    from runs import generate
    from trainmon.watch.run_watcher import RunWatcher, WatchOptions
    run = generate(tmp_path / "run", ranks=8, steps=40, inf_step=21, origin=5)
    watcher = RunWatcher(run, tmp_path / "view", WatchOptions(once=True))
    watcher.poll(final=True)
    step, grids = watcher.history.by_rank
    watcher.finish(draw=False)
    assert step == 21 and grids["actv"].ranks == list(range(8))
    assert np.isinf(grids["actv"].values[:, 5]).any() and np.isfinite(grids["actv"].values[:, 0]).all()
