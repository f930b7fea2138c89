"""The daemon's view: a fixed number of tags whatever the ranks, an overview that shows a failure, collectives
named by op and group role, and detail only for what the user selects."""
import math

from runs import generate, read_events, watch_once
from trainmon.watch.aggregate import StepFigures
from trainmon.watch.view import GroupRoles, View, ViewOptions, worst


def _tags(run, tmp_path, *flags):
    done = watch_once(run, "--logdir", tmp_path, "--heatmap-every", 1000, *flags)
    assert done.returncode == 0, done.stderr
    return read_events(tmp_path)[0]


def test_the_tag_count_does_not_depend_on_the_number_of_ranks(tmp_path):
    two = _tags(generate(tmp_path / "two", ranks=2, steps=12, inf_step=8, origin=1), tmp_path / "w2")
    four = _tags(generate(tmp_path / "four", ranks=4, steps=12, inf_step=8, origin=3), tmp_path / "w4")
    assert two.keys() == four.keys()
    assert len(four) < 100, sorted(four)  # 8 layers x 5 families, the overview, the heatmaps and text
    assert "comm/all_reduce@world/norm" in four  # one chart per op and group, not per call
    assert not any("#" in tag or "rank" in tag.split("/")[0] for tag in four)


def test_the_overview_shows_the_fault_where_it_happens(tmp_path):
    events = _tags(generate(tmp_path / "run", ranks=3, steps=12, inf_step=8, origin=1), tmp_path / "w")
    overview = sorted(tag for tag in events if tag.startswith("Overview/"))
    assert len(overview) <= 30, overview
    inf = dict(events["Overview/inf_elements"])
    assert all(inf[s] == 0 for s in range(8)) and all(inf[s] > 0 for s in range(8, 12))
    assert dict(events["Overview/tensors_nonfinite"])[8] > 0
    assert dict(events["Overview/first_nonfinite_rank"])[8] == 1.0  # the origin rank's layers.3, first in model order
    norm = dict(events["actv/layers.3/norm"])
    assert math.isfinite(norm[7]) and norm[8] == math.inf  # an Inf is drawn as +Inf, not as a finite norm
    assert dict(events["Overview/actv_norm_max"])[8] == math.inf
    assert dict(events["actv/inf_elements"])[8] >= 1


def test_detail_and_ranks_are_what_the_user_selects(tmp_path):
    events = _tags(generate(tmp_path / "run", ranks=3, steps=6, inf_step=4, origin=1), tmp_path / "w",
                   "--detail", r"layers\.3", "--ranks", 2)
    detail = {tag for tag in events if tag.startswith("detail/")}
    assert detail and all("layers.3" in tag for tag in detail)
    assert {tag.rsplit("_", 1)[-1] for tag in detail} >= {"min", "median", "max", "rank"}
    assert {tag.split("/")[0] for tag in events if tag.startswith("rank")} == {"rank2"}


def test_one_rank_gets_one_value_not_a_spread(tmp_path):
    events = _tags(generate(tmp_path / "run", ranks=1, steps=4, inf_step=2, origin=0), tmp_path / "w",
                   "--detail", r"layers\.0\.output")
    assert "detail/actv/layers.0.output/norm" in events and not any(t.endswith("_median") for t in events)
    assert not any(t.startswith("scalars/") for t in events)
    assert not (tmp_path / "w" / "ranks_min").exists()


def test_worst_and_the_overview_reduction_let_nan_win():
    assert math.isnan(worst([1.0, math.nan, math.inf])) and worst([1.0, math.inf]) == math.inf
    figure = StepFigures(3, stats={("actv", "a.0.x", 0, "norm"): (1.0, 1.0, 2.0, 0),
                                   ("actv", "a.1.x", 0, "norm"): (1.0, math.nan, math.nan, 1),
                                   ("actv", "a.1.x", 0, "min"): (-7.0, -1.0, -1.0, 0),
                                   ("actv", "a.1.x", 0, "max"): (3.0, 3.0, 5.0, 0)},
                         scalars={"loss": {0: 1.5, 1: math.nan}})
    values = dict(View(ViewOptions()).tag_values(figure))
    assert math.isnan(values["Overview/actv_norm_max"]) and math.isnan(values["Overview/loss"])
    assert values["Overview/actv_absmax"] == 7.0
    assert values["actv/a.0/norm"] == 2.0 and math.isnan(values["actv/a.1/norm"])


def test_the_overview_grad_norm_is_the_norm_before_clipping():
    """grad_reduced records are clipped: the overview's grad norm is a logged grad_norm, else the framework's norm
    before clipping, and only without either the norm of the records."""
    records = {0: {"grad_reduced": 0.25}}  # sum of squared norms: clipped to 0.5
    assert StepFigures(1, grad_sumsq=records).grad_norms() == {0: 0.5}
    preclip = StepFigures(1, grad_sumsq=records, scalars={"grad_norm_preclip": {0: 9.0}})
    assert preclip.grad_norms() == {0: 9.0}
    assert dict(View(ViewOptions()).tag_values(preclip))["Overview/grad_norm"] == 9.0
    logged = StepFigures(1, grad_sumsq=records, scalars={"grad_norm_preclip": {0: 9.0}, "grad_norm": {0: 7.0}})
    assert logged.grad_norms() == {0: 7.0}


def test_groups_are_named_by_their_role():
    roles = GroupRoles([{"world_size": 8, "parallel": {"dp": {"ranks": [0, 2]}, "tp": {"ranks": [0, 1]},
                                                       "pp": {"ranks": [0, 4]}}},
                        {"world_size": 8, "parallel": {"dp": {"ranks": [1, 3]}, "tp": {"ranks": [0, 1]}}}])
    assert roles.name([1, 3], p2p=False) == "dp" and roles.name([0, 1], p2p=False) == "tp"
    assert roles.name(list(range(8)), p2p=False) == "world" and roles.name([5, 6, 7], p2p=False) == "3ranks"
    assert roles.name([5], p2p=False) == "self"
    assert roles.name([0, 4], p2p=True) == "pp" and roles.name([6, 7], p2p=True) == "p2p"
    options = ViewOptions(roles=roles)
    assert options.layer("comm", "all_reduce[1,3]@7#12.output", 0) == "all_reduce@dp"
    assert options.layer("comm", "send[0->4]@9#0.input", 0) == "send@pp"
    assert options.layer("actv", "decoder.layers.3.mlp.output", 1) == "1:decoder.layers.3"


def test_a_selection_past_the_budget_is_said_once(tmp_path):
    run = generate(tmp_path / "run", ranks=3, steps=4, inf_step=2, origin=1)
    done = watch_once(run, "--logdir", tmp_path / "all", "--heatmap-every", 1000, "--detail", ".")
    assert done.returncode == 0 and done.stderr.count("narrow --detail or --ranks") == 1, done.stderr
    done = watch_once(run, "--logdir", tmp_path / "some", "--heatmap-every", 1000, "--detail", r"layers\.3")
    assert done.returncode == 0 and "narrow --detail" not in done.stderr, done.stderr


def test_each_layer_chart_draws_the_spread_over_ranks(tmp_path):
    """The sibling runs ranks_min and ranks_median hold each layer's per-rank value (the largest of its
    tensors) reduced over ranks, the run itself the max: computed here from the databases."""
    import numpy as np
    from trainmon import open_run
    run = generate(tmp_path / "run", ranks=4, steps=10, inf_step=6, origin=2)
    logdir = tmp_path / "w"
    assert watch_once(run, "--logdir", logdir, "--heatmap-every", 1000).returncode == 0
    runs = {stat: read_events(logdir / f"ranks_{stat}")[0] for stat in ("min", "median")}
    runs["max"] = read_events(logdir)[0]
    assert runs["min"].keys() == runs["median"].keys() and runs["min"].keys() <= runs["max"].keys()
    with open_run(run, "db") as monitor_run:
        frame = monitor_run.records()
    grads = frame[frame.family == "grad_reduced"]
    grads = grads.assign(layer=[".".join(name.split(".")[:2]) for name in grads.name])  # layers.<i>.mlp.<j>.weight
    checked = 0
    for (layer, step), group in grads.groupby(["layer", "step"]):
        per_rank = group.groupby("rank")["norm"].apply(lambda v: np.nan if v.isna().any() else v.max())
        finite = per_rank.dropna()
        tag = f"grad_reduced/{layer}/norm"
        got = {stat: dict(runs[stat][tag])[step] for stat in ("min", "median", "max")}
        assert got["min"] == float(np.float32(finite.min()))
        assert got["median"] == float(np.float32(finite.median()))
        assert (math.isnan(got["max"]) if per_rank.isna().any() else got["max"] == float(np.float32(per_rank.max())))
        checked += 1
    assert checked > 20
    assert any(math.isinf(dict(runs["max"]["actv/layers.3/norm"])[s]) for s in range(6, 10))
