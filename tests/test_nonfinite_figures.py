"""A NaN in one tensor and an Inf in another, read wherever a user reads figures: the CSV (pandas), the
per-rank TensorBoard file (TensorBoard's reader), `monitor.db` through `open_run`, `trainmon show`, and the
daemon's cross-rank figures. Each shows torch's figures (NaN, +Inf), never a finite-only 0; the finite-only
ops carry the finite values."""
import math

import pytest
import torch

from reference import assert_ops_close, reference_ops
from writer_helpers import monitored, tensorboard_scalars
from trainmon import open_run
from trainmon.cli import main
from trainmon.core.records import GRAD_REDUCED

pd = pytest.importorskip("pandas")  # the reader the CSV files are checked with (the `db` extra)

OPS = ["norm", "mean", "min", "max", "nans", "infs", "norm_finite", "mean_finite", "min_finite", "max_finite"]
FAULT_STEP = 1


@pytest.fixture
def poisoned(output_dir, write_config):
    """Step 1's reduced grads: a NaN in the first parameter's, a +Inf and a -Inf in the second's."""
    grads = {}

    def poison(monitor, step):
        if step == FAULT_STEP:
            params = monitor._optimizer.param_groups[0]["params"]
            params[0].grad.view(-1)[0] = math.nan
            params[1].grad.view(-1)[:2] = torch.tensor([math.inf, -math.inf])
            params[2].grad.view(-1)[0] = math.inf
            grads.update({i: params[i].grad.detach().clone() for i in range(3)})

    monitor, _ = monitored(write_config, steps=2, grad_acc_steps=1, on_step=poison, ops=OPS,
                           format=["csv", "tensorboard", "db"], xy_distribution=False, mv_distribution=False)
    run = open_run(monitor.output_dir, source="db")
    names = list(run.family(GRAD_REDUCED, steps=0).name)[:3]  # records follow the parameters' order
    return monitor.output_dir, {name: reference_ops(grads[i]) for i, name in enumerate(names)}


def test_csv_db_and_tensorboard_carry_nan_and_inf(poisoned):
    rank_dir, expected = poisoned
    for source in ("csv", "db"):
        frame = open_run(rank_dir, source=source).family(GRAD_REDUCED, steps=FAULT_STEP)
        for name, want in expected.items():
            row = frame[frame.name == name].iloc[0].to_dict()
            assert_ops_close(row, want, OPS, context=f"{source} {name}")
    first, both, plus = expected
    assert math.isnan(expected[first]["norm"]) and expected[both]["norm"] == math.inf
    assert math.isnan(expected[both]["mean"]) and expected[plus]["mean"] == math.inf
    assert expected[both]["min"] == -math.inf and expected[plus]["max"] == math.inf
    assert math.isfinite(expected[plus]["min"]) and math.isfinite(expected[first]["norm_finite"])

    csv = pd.concat([pd.read_csv(f) for f in rank_dir.glob("grad_reduced_*.csv")])
    cell = csv[(csv.name == first) & (csv.step == FAULT_STEP)]
    assert math.isnan(cell["norm"].iloc[0]) and cell["norm_finite"].iloc[0] == pytest.approx(
        expected[first]["norm_finite"], rel=1e-6)

    scalars = tensorboard_scalars(rank_dir)
    tags = {tag for tag, _ in scalars}

    def value(name: str, op: str) -> float:
        tag = next(t for t in tags if f"{name}/" in t and t.endswith(f"_{op}") and GRAD_REDUCED_TAG in t)
        return scalars[(tag, FAULT_STEP)]

    assert math.isnan(value(first, "norm")) and value(both, "norm") == math.inf and value(plus, "max") == math.inf
    assert value(first, "norm_finite") == pytest.approx(expected[first]["norm_finite"], rel=1e-6)


GRAD_REDUCED_TAG = "post_grad"


def test_show_prints_nan_and_inf(poisoned, capsys):
    rank_dir, expected = poisoned
    first, both, _ = expected
    assert main(["show", str(rank_dir), "--family", GRAD_REDUCED, "--step", str(FAULT_STEP), "--ops",
                 "norm,norm_finite"]) == 0
    rows = {line.split()[1].split("/")[0].split(":")[1]: line.split()[-2:] for line in
            capsys.readouterr().out.splitlines()[1:]}
    assert rows[first][0] == "NaN" and float(rows[first][1]) == pytest.approx(expected[first]["norm_finite"], abs=1e-6)
    assert rows[both][0] == "inf"


def test_the_daemons_cross_rank_max_is_the_non_finite_value(poisoned):
    from trainmon.watch.follow import RankFollower
    from trainmon.watch.run_watcher import read_figures
    from trainmon.read.layout import find_run
    rank_dir, expected = poisoned
    followers = [RankFollower(r) for r in find_run(rank_dir).ranks]
    for follower in followers:
        follower.poll(final=True)
    stats = read_figures(followers, FAULT_STEP, FAULT_STEP)[FAULT_STEP].stats
    first, both, plus = expected
    assert math.isnan(stats[(GRAD_REDUCED, first, 0, "norm")][2])
    assert stats[(GRAD_REDUCED, both, 0, "norm")][2] == math.inf
    assert stats[(GRAD_REDUCED, plus, 0, "max")][2] == math.inf
    assert stats[(GRAD_REDUCED, first, 0, "norm_finite")][2] == pytest.approx(expected[first]["norm_finite"])


def test_the_global_grad_norm_is_nan_when_a_grad_is(poisoned):
    from trainmon.watch.follow import RankFollower
    from trainmon.watch.run_watcher import read_figures
    from trainmon.read.layout import find_run
    rank_dir, _ = poisoned
    followers = [RankFollower(r) for r in find_run(rank_dir).ranks]
    for follower in followers:
        follower.poll(final=True)
    figures = read_figures(followers, 0, FAULT_STEP)
    assert math.isfinite(figures[0].grad_norms()[0]) and math.isnan(figures[FAULT_STEP].grad_norms()[0])
