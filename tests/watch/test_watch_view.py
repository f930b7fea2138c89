"""The daemon's view: a fixed number of tags whatever the ranks, a first group of at most 12 headline charts, a
headline that stays on the incident, every layer chart showing its failure, collectives named by op and group role,
and detail only for what the user selects."""
import math

import numpy as np
import pytest

from runs import OPS, generate, read_events, read_texts, watch_once
from trainmon.config.output import write_json
from trainmon.core.layout import DB_NAME, RUN_JSON
from trainmon.core.records import PARAM_ORIGIN, RecordKey
from trainmon.watch.aggregate import Place, StepFigures
from trainmon.watch.view import NONFINITE_RUN, GroupRoles, View, ViewOptions, worst
from trainmon.writers import db_schema
from trainmon.writers.db_sink import MonitorDb


def _scalars(view: View, figure: StepFigures) -> dict:
    return dict(view.tags(figure).scalars)


def _tags(run, tmp_path, *flags):
    done = watch_once(run, "--logdir", tmp_path, "--heatmap-every", 1000, *flags)
    assert done.returncode == 0, done.stderr
    return read_events(tmp_path)[0]


@pytest.mark.slow
def test_the_tag_count_does_not_depend_on_the_number_of_ranks(tmp_path):
    two = _tags(generate(tmp_path / "two", ranks=2, steps=12, inf_step=8, origin=1), tmp_path / "w2")
    four = _tags(generate(tmp_path / "four", ranks=4, steps=12, inf_step=8, origin=3), tmp_path / "w4")
    assert two.keys() == four.keys()
    assert len(four) < 100, sorted(four)  # 8 layers x 5 families, the overview, the heatmaps and text
    assert "comm/norm of all_reduce@world" in four  # one chart per op and group, not per call
    assert not any("#" in tag or "rank" in tag.split("/")[0] for tag in four)


@pytest.mark.slow
def test_the_overview_shows_the_fault_where_it_happens(tmp_path):
    logdir = tmp_path / "w"
    events = _tags(generate(tmp_path / "run", ranks=3, steps=12, inf_step=8, origin=1), logdir)
    overview = sorted(tag for tag in events if tag.startswith("Overview/"))
    assert len(overview) <= 12, overview  # TensorBoard's first page of its first group
    inf = dict(events["Overview/inf_elements"])
    assert all(inf[s] == 0 for s in range(8)) and all(inf[s] > 0 for s in range(8, 12))
    assert dict(events["Overview/tensors_nonfinite"])[8] > 0
    # the origin rank's layers.3, first in model order, at every step from the incident on
    assert events["Overview/first_nonfinite_rank in layers.3 (actv)"] == [(step, 1.0) for step in range(8, 12)]
    # the Inf is written as NaN, which TensorBoard draws (an infinity breaks the chart), never as a finite norm
    norm = dict(events["actv/norm of layers.3"])
    assert math.isfinite(norm[7]) and math.isnan(norm[8])
    assert math.isnan(dict(events["Worst tensor/actv norm"])[8])
    assert dict(events["actv/inf_elements"])[8] >= 1
    # and the layer's chart draws its NaN/Inf elements beside the norm, from the incident on only
    elements = dict(read_events(logdir, "nonfinite_elements")[0]["actv/norm of layers.3"])
    assert min(elements) == 8 and elements[8] >= 1
    # Custom Scalars opens on the same headline: its first category, the only one open
    categories = _custom_scalars_layout(logdir).category
    assert categories[0].title == "Overview" and not categories[0].closed
    assert all(category.closed for category in categories[1:])
    titles = [chart.title for chart in categories[0].chart]  # this run logs no loss
    assert titles[:2] == ["grad_norm", "params_norm"] and "NaN and Inf elements" in titles


@pytest.mark.slow
def test_detail_and_ranks_are_what_the_user_selects(tmp_path):
    events = _tags(generate(tmp_path / "run", ranks=3, steps=6, inf_step=4, origin=1), tmp_path / "w",
                   "--detail", r"layers\.3", "--ranks", 2)
    detail = {tag for tag in events if tag.startswith("detail/")}
    assert detail and all("layers.3" in tag for tag in detail)
    assert {tag.rsplit("_", 1)[-1] for tag in detail} >= {"min", "median", "max", "rank"}
    assert {tag.split("/")[0] for tag in events if tag.startswith("rank")} == {"rank2"}


@pytest.mark.slow
def test_one_rank_gets_one_value_not_a_spread(tmp_path):
    events = _tags(generate(tmp_path / "run", ranks=1, steps=4, inf_step=2, origin=0), tmp_path / "w",
                   "--detail", r"layers\.0\.output")
    assert "detail/actv/layers.0.output/norm" in events and not any(t.endswith("_median") for t in events)
    assert not any(t.startswith("scalars/") for t in events)
    assert not (tmp_path / "w" / "min").exists()


def test_worst_and_the_overview_reduction_let_nan_win():
    assert math.isnan(worst([1.0, math.nan, math.inf])) and worst([1.0, math.inf]) == math.inf
    figure = StepFigures(3, stats={("actv", "a.0.x", 0, "norm"): (1.0, 1.0, 2.0, 0),
                                   ("actv", "a.1.x", 0, "norm"): (1.0, math.nan, math.nan, 1),
                                   ("actv", "a.1.x", 0, "min"): (-7.0, -1.0, -1.0, 0),
                                   ("actv", "a.1.x", 0, "max"): (3.0, 3.0, 5.0, 0)},
                         scalars={"loss": {0: 1.5, 1: math.nan}})
    values = _scalars(View(ViewOptions()), figure)
    assert math.isnan(values["Worst tensor/actv norm"]) and math.isnan(values["Overview/loss"])
    assert values["Worst tensor/actv absmax"] == 7.0
    assert values["actv/norm of a.0"] == 2.0 and math.isnan(values["actv/norm of a.1"])


def test_the_overview_grad_norm_is_the_norm_before_clipping():
    """grad_reduced records are clipped: the overview's grad norm is a logged grad_norm, else the framework's norm
    before clipping, and only without either the norm of the records."""
    records = {0: {"grad_reduced": 0.25}}  # sum of squared norms: clipped to 0.5
    assert StepFigures(1, norm_sumsq=records).grad_norms() == {0: 0.5}
    preclip = StepFigures(1, norm_sumsq=records, scalars={"grad_norm_preclip": {0: 9.0}})
    assert preclip.grad_norms() == {0: 9.0}
    assert _scalars(View(ViewOptions()), preclip)["Overview/grad_norm"] == 9.0
    logged = StepFigures(1, norm_sumsq=records, scalars={"grad_norm_preclip": {0: 9.0}, "grad_norm": {0: 7.0}})
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


@pytest.mark.slow
def test_a_selection_past_the_budget_is_said_once(tmp_path):
    run = generate(tmp_path / "run", ranks=3, steps=4, inf_step=2, origin=1)
    done = watch_once(run, "--logdir", tmp_path / "all", "--heatmap-every", 1000, "--detail", ".")
    assert done.returncode == 0 and done.stderr.count("narrow --detail or --ranks") == 1, done.stderr
    done = watch_once(run, "--logdir", tmp_path / "some", "--heatmap-every", 1000, "--detail", r"layers\.3")
    assert done.returncode == 0 and "narrow --detail" not in done.stderr, done.stderr


@pytest.mark.slow
def test_each_layer_chart_draws_the_spread_over_ranks(tmp_path):
    """The sibling runs min and median hold each layer's per-rank value (the largest of its tensors) reduced over
    ranks, the run max the max: computed here from the databases."""
    import numpy as np
    from trainmon import open_run
    run = generate(tmp_path / "run", ranks=4, steps=10, inf_step=6, origin=2)
    logdir = tmp_path / "w"
    assert watch_once(run, "--logdir", logdir, "--heatmap-every", 1000).returncode == 0
    runs = {stat: read_events(logdir, stat)[0] for stat in ("min", "median", "max")}
    assert runs["min"].keys() == runs["median"].keys() and runs["min"].keys() <= runs["max"].keys()
    with open_run(run, "db") as monitor_run:
        frame = monitor_run.records()
    grads = frame[frame.family == "grad_reduced"]
    grads = grads.assign(layer=[".".join(name.split(".")[:2]) for name in grads.name])  # layers.<i>.mlp.<j>.weight
    checked = 0
    for (layer, step), group in grads.groupby(["layer", "step"]):
        per_rank = group.groupby("rank")["norm"].apply(lambda v: np.nan if v.isna().any() else v.max())
        finite = per_rank.dropna()
        tag = f"grad_reduced/norm of {layer}"
        got = {stat: dict(runs[stat][tag])[step] for stat in ("min", "median", "max")}
        want = {"min": finite.min(), "median": finite.median(), "max": per_rank.max(skipna=False)}
        for stat, value in want.items():  # as written: float32, ±Inf as NaN
            assert math.isnan(got[stat]) if not math.isfinite(value) else got[stat] == float(np.float32(value))
        checked += 1
    assert checked > 20
    assert all(math.isnan(dict(runs["max"]["actv/norm of layers.3"])[s]) for s in range(6, 10))


@pytest.mark.slow
def test_the_headline_stays_on_the_incident(tmp_path):
    """4 ranks, the Inf entering rank 2's layers.3 at step 6: the text names it once, at its step, later steps'
    first places follow as "then reached", and the rank charted is 2 at every step after."""
    logdir = tmp_path / "w"
    events = _tags(generate(tmp_path / "run", ranks=4, steps=10, inf_step=6, origin=2), logdir)
    texts = read_texts(logdir)
    [(step, incident)] = texts["Overview/first_nonfinite"]
    assert step == 6 and "**layers.3**" in incident and "`layers.3.output`" in incident and "on rank 2" in incident
    assert "micro-step 0" in incident
    later = texts["Overview/first_nonfinite_then_reached"]
    assert later and all(step > 6 and "then reached" in text for step, text in later)
    # the chart of its rank says where: the incident's layer is in its name
    assert events["Overview/first_nonfinite_rank in layers.3 (actv)"] == [(step, 2.0) for step in range(6, 10)]


def test_the_first_group_holds_the_headline_and_the_worst_tensors_their_own():
    scalars = {name: {0: 1.0} for name in ("loss", "lm loss", "learning_rate", "loss_scale", "amp_updates")}
    figure = StepFigures(3, stats={("actv", "a.0.x", 0, "norm"): (1.0, 1.0, 2.0, 0),
                                   ("param_origin", "a.0.w", 0, "norm"): (3.0, 3.0, 3.0, 0)},
                         scalars=scalars, norm_sumsq={0: {"param_origin": 16.0, "grad_reduced": 4.0}},
                         params_sumsq=16.0, params_ranks=(0,), recorded=True,
                         worst=Place("actv", "a.0.x", 0, 0, 0))
    values = _scalars(View(ViewOptions(single_rank=True)), figure)
    assert {tag for tag in values if tag.startswith("Overview/")} == {
        "Overview/loss", "Overview/grad_norm", "Overview/learning_rate", "Overview/loss_scale", "Overview/params_norm",
        "Overview/nan_elements", "Overview/inf_elements", "Overview/tensors_nonfinite", "Overview/stalled_ranks",
        "Overview/first_nonfinite_rank in a.0 (actv)"}
    assert values["Overview/grad_norm"] == 2.0 and values["Overview/params_norm"] == 4.0  # sqrt of the sums
    assert values["Worst tensor/param_origin norm"] == 3.0  # a tensor's norm, apart from the global one
    assert {tag for tag in values if tag.startswith("scalars/")} == {"scalars/lm loss", "scalars/amp_updates"}


def test_megatrons_scalar_names_are_the_headline():
    """A job that logs Megatron's names (`lm loss`, `grad-norm`, `learning-rate`, `loss-scale`, `params-norm`) has
    them in Overview, its own norms in place of those computed from the records (which stay in `scalars/`)."""
    scalars = {name: {0: value} for name, value in (("lm loss", 2.5), ("grad-norm", 7.0), ("learning-rate", 1e-4),
                                                    ("loss-scale", 4096.0), ("params-norm", 9.0))}
    figure = StepFigures(3, scalars=scalars, norm_sumsq={0: {"param_origin": 16.0, "grad_reduced": 4.0}},
                         params_sumsq=16.0, params_ranks=(0,), recorded=True)
    values = _scalars(View(ViewOptions(single_rank=True)), figure)
    assert {tag: values[tag] for tag in values if tag.startswith("Overview/") and "_elements" not in tag
            and "nonfinite" not in tag and "stalled" not in tag} == {
        "Overview/lm loss": 2.5, "Overview/grad-norm": 7.0, "Overview/learning-rate": 1e-4,
        "Overview/loss-scale": 4096.0, "Overview/params-norm": 9.0}
    assert {tag: values[tag] for tag in values if tag.startswith("scalars/")} == {
        "scalars/grad_norm": 2.0, "scalars/params_norm": 4.0}


def test_a_nan_loss_is_drawn_in_the_loss_chart_as_the_ranks_holding_it():
    """The loss chart's `nonfinite_elements` line counts the ranks whose loss is NaN or Inf, from the first on (0 at a
    later step without), where TensorBoard would draw the NaN at the last finite value, as a flat line."""
    view = View(ViewOptions())

    def siblings(losses: dict) -> dict:
        figure = StepFigures(0, scalars={"loss": losses}, recorded=True)
        return dict(view.tags(figure).siblings.get(NONFINITE_RUN, []))

    assert siblings({0: 0.7, 1: 0.6}) == {}
    assert siblings({0: 0.7, 1: math.nan, 2: math.inf})["Overview/loss"] == 2.0
    assert siblings({0: 0.7, 1: 0.6, 2: 0.5})["Overview/loss"] == 0.0


def test_a_model_output_grad_of_exactly_one_is_left_out_of_the_worst_tensors():
    def figure(output_grad: float) -> StepFigures:
        stats = {("actv_grad", "layers.0.output", 0, op): (0.5, 0.5, 0.5, 0) for op in ("norm", "min", "max")}
        stats.update({("actv_grad", ".output", 0, op): (output_grad, output_grad, output_grad, 0)
                      for op in ("norm", "min", "max")})
        return StepFigures(0, stats=stats)

    dloss = _scalars(View(ViewOptions()), figure(1.0))  # dL/dL: the forward returned the loss
    assert dloss["Worst tensor/actv_grad norm"] == 0.5 and dloss["Worst tensor/actv_grad absmax"] == 0.5
    scaled = _scalars(View(ViewOptions()), figure(4.0))  # a model output's grad that carries information stays
    assert scaled["Worst tensor/actv_grad norm"] == 4.0 and scaled["Worst tensor/actv_grad absmax"] == 4.0


def test_the_params_norm_is_the_global_norm_of_the_weights(tmp_path):
    """Overview/params_norm, as Megatron's params-norm: the square root of the sum over the model's distinct
    parameters of their squared norms (param_origin records), each once. Ranks 0 and 1 are data-parallel replicas
    holding layers.0 (norm 3, its pieces merged), rank 2 the next pipeline stage's layers.1 (norm 4): 5 on every
    rank, not one rank's 3 or 4."""
    run = tmp_path / "run"
    held = {0: ["layers.0.weight"], 1: ["layers.0.weight"], 2: ["layers.1.weight"]}
    sumsq = {"layers.0.weight": 9.0, "layers.1.weight": 16.0}
    for rank, names in held.items():
        (run / f"rank_{rank}").mkdir(parents=True)
        write_json(run / f"rank_{rank}" / RUN_JSON, {"rank": rank, "pp_stage": rank // 2})
        db = MonitorDb(run / f"rank_{rank}" / DB_NAME)
        db.set_meta({"schema_version": db_schema.SCHEMA_VERSION, "rank": rank, "ops": OPS,
                     "fields": list(db_schema.FIELDS)})
        keys = [RecordKey(PARAM_ORIGIN, name, 0, None, i, (4, 4), "torch.float32") for i, name in enumerate(names)]
        for step in range(3):
            fields = [{"count": 16.0, "sumsq": sumsq[name] * (1 + step), "min": -1.0, "max": 1.0} for name in names]
            db.add_step(step, 0, keys, np.array([[f.get(n, 0.0) for n in db_schema.FIELDS] for f in fields]), {})
        db.close()
    got = dict(_tags(run, tmp_path / "w")["Overview/params_norm"])
    assert got == pytest.approx({step: 5.0 * math.sqrt(1 + step) for step in range(3)})


def _custom_scalars_layout(logdir):
    """The custom-scalars layout the view's `max` run holds, as TensorBoard reads it."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    found = None
    for path in sorted((logdir / "max").glob("events.out.tfevents.*")):
        for record in RawEventFileLoader(str(path)).Load():
            for value in Event.FromString(record).summary.value:
                if value.tag == metadata.CONFIG_SUMMARY_TAG:
                    found = layout_pb2.Layout.FromString(value.tensor.string_val[0])  # the latest one counts
    assert found is not None, "no custom-scalars layout"
    return found
