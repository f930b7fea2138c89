"""msprobe's L2 features (`recording_l2_features`, `l2_targets`, `sa_order`): each value equals msprobe 26.2's on the
same model and seed, at the same steps and micro-steps (msprobe's own TrainerMon where it is installed, its formulas
re-derived here everywhere), with no host synchronisation in the hooks, and in every sink."""
import json
import math
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from op_log import Ops
from trainmon import TrainerMon, open_run
from trainmon.hooks import features

HIDDEN, HEADS, SEQ, BATCH, EXPERTS = 16, 2, 6, 2, 4
STEPS, GA = 3, 2
L2_TARGETS = {"attention_hook": ["core"], "linear_hook": [], "moe_router_weight_hook": ["router"],
              "moe_router_logit_hook": ["router"]}


class CoreAttention(nn.Module):
    """A plain torch attention module whose inputs are q and k (and v), in the layout `order`."""

    def __init__(self, order: str):
        super().__init__()
        self.order = order

    def forward(self, q, k, v):
        # to [b, h, s, d] and back
        perm = (1, 2, 0, 3) if self.order == "s,b,h,d" else (0, 2, 1, 3)
        back = (2, 0, 1, 3) if self.order == "s,b,h,d" else (0, 2, 1, 3)
        out = F.scaled_dot_product_attention(*(t.permute(*perm) for t in (q, k, v)), is_causal=True)
        return out.permute(*back)


class Model(nn.Module):
    """Every hooked module kind: linears, an attention core taking q and k, a router (weight and logits)."""

    def __init__(self, order: str):
        super().__init__()
        self.order = order
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.core = CoreAttention(order)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS))
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, HIDDEN // HEADS)).unbind(-3)
        h = x + self.core(q, k, v).flatten(-2)
        gates = self.router(h).softmax(-1)
        h = h + sum(gates[..., e:e + 1] * expert(h) for e, expert in enumerate(self.experts))
        return self.out(h).square().mean()


def batches(order: str, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    shape = (SEQ, BATCH, HIDDEN) if order == "s,b,h,d" else (BATCH, SEQ, HIDDEN)
    while True:
        yield torch.randn(shape, generator=gen)


def train(monitor_factory, order: str, wrap=None):
    """STEPS steps of GA micro-batches of Model under a monitor made by `monitor_factory(model, optimizer)`; the
    model trained through `wrap(model)` where given (torch.compile)."""
    torch.manual_seed(0)
    model = Model(order)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    monitor = monitor_factory(model, optimizer)
    if wrap is not None:
        model = wrap(model)
    data = batches(order)
    for _ in range(STEPS):
        for _ in range(GA):
            model(next(data)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return monitor


def trainmon_features(output_dir, write_config, order: str, wrap=None, **settings) -> dict:
    """{(hook family, module, feature, step, micro_step or None): value} as trainmon writes them (the db)."""
    config = write_config(recording_l2_features=True, l2_targets=L2_TARGETS, sa_order=order, format=["db"],
                          ops=["min", "max", "mean"], **settings)
    monitor = train(lambda m, o: TrainerMon(config).set_monitor(m, optimizer=o, grad_acc_steps=GA), order, wrap)
    monitor.stop()
    with open_run(monitor.output_dir.parent) as run:
        frame = run.records()
    out = {}
    for row in frame[frame.family.str.endswith("_hook")].itertuples():
        module, _, feature = row.name.rpartition(".")
        micro = None if row.micro_step is None or (isinstance(row.micro_step, float) and math.isnan(row.micro_step)) \
            else int(row.micro_step)
        assert row.min == row.max == row.mean  # a one-element record: its figures are the value
        out[(row.family, module, feature, int(row.step), micro)] = row.max
    return out


def msprobe_features(tmp_path, monkeypatch, order: str) -> dict:
    """The same keys from msprobe's own TrainerMon (its CSV files). Its power iteration starts from the global
    generator at each call; here msprobe's module draws its start vector as trainmon does (seed
    features.POWER_ITERATION_SEED, not from the training's random stream), which leaves its formula as it is."""
    module_hook = pytest.importorskip("msprobe.pytorch.monitor.module_hook")
    import msprobe.pytorch.monitor.features as msprobe_formulas
    import pandas

    def randn(*shape, **kw):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(features.POWER_ITERATION_SEED), **kw)

    monkeypatch.setattr(msprobe_formulas, "torch", types.SimpleNamespace(**{**vars(torch), "randn": randn}))
    out_dir = tmp_path / "msprobe_output"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out_dir))
    config = tmp_path / "msprobe.json"
    # msprobe's l2_targets names carry the chunk prefix; "linear_hook": [] takes every 2-D weight in both
    config.write_text(json.dumps({"targets": {}, "recording_l2_features": True, "sa_order": order, "format": "csv",
                                  "l2_targets": {k: [f"0:{n}" for n in v] for k, v in L2_TARGETS.items()}}))
    train(lambda m, o: module_hook.TrainerMon(str(config), params_have_main_grad=False).set_monitor(
        m, grad_acc_steps=GA, optimizer=o), order)
    columns = {"attention_hook": features.ATTENTION_FEATURES[:2], "linear_hook": features.LINEAR_FEATURES,
               "moe_router_weight_hook": features.ROUTER_WEIGHT_FEATURES,
               "moe_router_logit_hook": features.ROUTER_LOGIT_FEATURES}
    out = {}
    for family, names in columns.items():
        for path in out_dir.rglob(f"{family}_*.csv"):
            for row in pandas.read_csv(path).itertuples():
                module = row.name.rsplit(".", 1)[0]  # msprobe writes <module>.attention, .linear, .moe_router
                micro = int(row.micro_step) if hasattr(row, "micro_step") else None
                for feature in names:
                    out[(family, module, feature, int(row.step), micro)] = getattr(row, feature)
    return out


@pytest.mark.parametrize("order", ["s,b,h,d", "b,s,h,d"])
def test_every_feature_equals_msprobes_at_the_same_steps_and_micro_steps(tmp_path, output_dir, write_config,
                                                                          monkeypatch, order):
    ours = trainmon_features(output_dir, write_config, order)
    theirs = msprobe_features(tmp_path, monkeypatch, order)
    compared = {key: value for key, value in ours.items() if key[2] != "max_logit"}  # max_logit is trainmon's
    assert compared.keys() == theirs.keys()
    assert {key[0] for key in theirs} == set(L2_TARGETS)
    assert len({key[1] for key in theirs if key[0] == "linear_hook"}) == 3 + EXPERTS  # qkv, router, experts, out
    for key, value in theirs.items():
        assert compared[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key  # msprobe rounds its CSV to 6 places


def _power_iteration(w: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """msprobe's max_eigenvalue, re-derived: three iterations with the matrix WᵀW."""
    a, u, estimate = w.t() @ w, start, torch.tensor(0.0)
    for _ in range(3):
        v = a @ u
        estimate = v @ u
        if v.norm() == 0:
            return torch.tensor(0.0)
        u = v / v.norm()
    return estimate.sqrt()


def test_the_formulas_re_derived():
    """Without msprobe: each feature from its definition, computed here another way."""
    torch.manual_seed(3)
    q, k = torch.randn(8, 2, 3, 4), torch.randn(8, 2, 3, 4)
    logits = q[:, 0, 0] @ k[:, 0, 0].t() / 2.0  # head 0 of sequence 0, / sqrt(d)
    entropy, softmax_max = [], []
    for i in range(8):  # query i attends to keys 0..i
        p = logits[i, : i + 1].softmax(0)
        entropy.append(float(-(p * p.log()).sum()))
        softmax_max.append(float(p.max()))
    got = features.attention_features(q, k, "s,b,h,d")
    assert got.tolist() == pytest.approx([sum(entropy) / 8, sum(softmax_max) / 8,
                                          float(logits.tril().masked_fill(torch.ones(8, 8).triu(1).bool(),
                                                                          -1e9).max())], rel=1e-5)
    assert features.attention_features(q.transpose(0, 1), k.transpose(0, 1), "b,s,h,d").tolist() == got.tolist()

    w = torch.randn(5, 7)
    start = features.power_iteration_start(7, torch.device("cpu"))
    sr, kernel = features.stable_rank(w, start).tolist()
    assert kernel == pytest.approx(float(_power_iteration(w, start)), rel=1e-5)
    assert sr == pytest.approx(float(w.norm()) / kernel, rel=1e-5)
    assert kernel <= float(torch.linalg.matrix_norm(w, 2)) * (1 + 1e-6)  # a power iteration's estimate, from below
    assert features.stable_rank(torch.zeros(5, 7), start).tolist() == [0.0, 0.0]  # msprobe: 0, 0

    router = torch.randn(4, 7)  # nn.Linear's [experts, hidden]
    unit = router / router.norm(dim=1, keepdim=True)
    pairs = [float(unit[i] @ unit[j]) for i in range(4) for j in range(i + 1, 4)]
    assert float(features.router_weight_similarity(router)) == pytest.approx(sum(pairs) / len(pairs), rel=1e-5)
    assert float(features.router_weight_similarity(router.t())) == pytest.approx(sum(pairs) / len(pairs), rel=1e-5)

    expert_logits = torch.randn(3, 5, 4)
    expert_logits[0, 0, 1] = -math.inf  # a masked expert counts 0
    p = expert_logits.reshape(-1, 4).softmax(-1)
    per_token = [-sum(float(x * math.log(x)) for x in row if x > 0) for row in p]
    assert float(features.per_token_expert_entropy(expert_logits)) == pytest.approx(sum(per_token) / 15, rel=1e-5)


def test_the_hooks_read_nothing_on_the_host_and_nothing_on_steps_not_collected(output_dir, write_config):
    config = write_config(recording_l2_features=True, l2_targets=L2_TARGETS, format=["csv"], ops=["max"],
                          step_interval=2)
    torch.manual_seed(0)
    model = Model("s,b,h,d")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(config).set_monitor(model, optimizer=optimizer)
    x = next(batches("s,b,h,d"))
    counted = []
    for _ in range(2):
        model(x).backward()  # the features are computed in forward hooks
        with Ops() as reads:
            model(x)
        counted.append(reads.ops)
        optimizer.step()
    monitor.stop()
    with Ops() as plain:
        model(x)
    collected, skipped = counted
    assert "aten._local_scalar_dense" not in collected and "aten.item" not in collected
    assert len(collected) > len(plain.ops) and len(skipped) == len(plain.ops)  # step 1 is not collected


def test_every_sink_and_show_have_the_features(output_dir, write_config, capsys):
    """csv, the record stream (db on a network filesystem), TensorBoard and the api hold the same values, and
    `trainmon show --family` prints them."""
    from trainmon.cli import main
    from writer_helpers import tensorboard_scalars

    config = write_config(recording_l2_features=True, l2_targets=L2_TARGETS, format=["csv", "db", "tensorboard"],
                          ops=["max"], output_filesystem="network")
    monitor = train(lambda m, o: TrainerMon(config).set_monitor(m, optimizer=o, grad_acc_steps=GA), "s,b,h,d")
    api = monitor._latest(["attention_hook"])  # the last step's, once the writer has written it
    monitor.stop()
    run, rank_dir = monitor.output_dir.parent, monitor.output_dir
    assert (rank_dir / "records.stream").exists() and not (rank_dir / "monitor.db").exists()
    by_format = {}
    for fmt in ("csv", "db"):
        with open_run(run, fmt) as data:
            frame = data.records()
        frame = frame[frame.family.str.endswith("_hook")]
        by_format[fmt] = {(r.family, r.name, int(r.step), None if r.micro_step != r.micro_step else int(r.micro_step)):
                          r.max for r in frame.itertuples()}
    # attention per micro-step (3 features), linears once a step (2 each), router weight once, router logits per
    # micro-step
    assert len(by_format["db"]) == STEPS * (GA * 3 + 2 * (3 + EXPERTS) + 1 + GA)
    assert by_format["csv"].keys() == by_format["db"].keys()
    for key, value in by_format["db"].items():
        assert by_format["csv"][key] == pytest.approx(value, rel=1e-5)
    last = STEPS - 1
    entropy = by_format["db"][("attention_hook", "core.entropy", last, GA - 1)]
    assert api[f"0:core.entropy:{GA - 1}/rank0/attention_hook"]["max"] == pytest.approx(entropy, rel=1e-6)
    scalars = tensorboard_scalars(rank_dir)
    assert scalars[(f"0:core.entropy:{GA - 1}/rank0/attention_hook_max", last)] == pytest.approx(entropy, rel=1e-6)
    kernel = by_format["db"][("linear_hook", "qkv.kernel_norm", last, None)]
    assert scalars[("0:qkv.kernel_norm/rank0/linear_hook_max", last)] == pytest.approx(kernel, rel=1e-6)
    assert main(["show", str(run), "--family", "linear_hook", "--steps", str(last)]) == 0
    printed = capsys.readouterr().out
    assert "qkv.kernel_norm" in printed and "out.sr" in printed and "core.entropy" not in printed


def test_a_module_without_q_and_k_and_a_misspelled_target_are_said_once(output_dir, write_config, caplog):
    config = write_config(recording_l2_features=True, format=["csv"], ops=["max"],
                          l2_targets={"attention_hook": ["out", "nowhere"]})
    with caplog.at_level("WARNING", logger="trainmon"):
        monitor = train(lambda m, o: TrainerMon(config).set_monitor(m, optimizer=o, grad_acc_steps=GA), "s,b,h,d")
        monitor.stop()
    said = [r.getMessage() for r in caplog.records]
    assert sum("attention_hook: nowhere" in m for m in said) == 1
    assert sum("attention_hook is not recorded for out" in m and "q and k" in m for m in said) == 1


def test_a_compiled_model_records_the_eager_features_in_one_graph(output_dir, write_config, tmp_path, monkeypatch):
    """Inside a torch.compile'd region the graph runs the feature hooks on each call's tensors: the same records as
    eager, one graph (fullgraph: a graph break would raise), and none compiled again as collecting turns on and off
    (`step_interval`)."""
    from torch._dynamo.utils import counters

    eager = trainmon_features(output_dir, write_config, "s,b,h,d", step_interval=2)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "compiled"))
    torch._dynamo.reset()
    counters.clear()
    compiled = trainmon_features(output_dir, write_config, "s,b,h,d", step_interval=2,
                                 wrap=lambda model: torch.compile(model, backend="aot_eager", fullgraph=True))
    assert counters["stats"]["unique_graphs"] == 1
    assert {key[3] for key in eager} == {0, 2} and compiled.keys() == eager.keys()
    assert {key[0] for key in compiled} == set(L2_TARGETS)
    for key, value in eager.items():
        assert compiled[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
