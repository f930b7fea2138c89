"""The view of the one-value families (L2 features, MoE load): per value one chart per layer and its worst over the
model in the overview, equal to the figures the database holds; the experts' loads as a layer x expert heatmap, not
as charts; a fixed number of tags whatever the modules."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from runs import read_events, watch_once
from trainmon import TrainerMon, open_run

HIDDEN, HEADS, SEQ, BATCH, EXPERTS, STEPS, GA = 16, 2, 6, 2, 4, 4, 2


class Core(torch.nn.Module):
    def forward(self, q, k, v):  # [s, b, h, d]
        return F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                              is_causal=True).permute(2, 0, 1, 3)


class Layer(torch.nn.Module):
    def __init__(self, gate_class):
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.core = Core()
        self.gate = gate_class(HIDDEN, EXPERTS, k=1, capacity_factor=1.0, min_capacity=1)
        self.mlp = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, HIDDEN // HEADS)).unbind(-3)
        x = x + self.core(q, k, v).flatten(-2)
        l_aux, combine, _, _ = self.gate(x.reshape(-1, HIDDEN))
        return x + self.mlp(x), l_aux + combine.sum()


class Model(torch.nn.Module):
    def __init__(self, gate_class):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(gate_class) for _ in range(3))

    def forward(self, x):
        extra = 0
        for layer in self.layers:
            x, aux = layer(x)
            extra = extra + aux
        return x.square().mean() + extra


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    gate_class = pytest.importorskip("deepspeed.moe.sharded_moe").TopKGate
    folder = tmp_path_factory.mktemp("features")
    config = folder / "config.json"
    config.write_text(json.dumps({"recording_l2_features": True, "moe_load": True, "format": ["db"],
                                  "ops": ["min", "max", "norm"],
                                  "l2_targets": {"attention_hook": [f"layers.{i}.core" for i in range(3)],
                                                 "linear_hook": []}}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MONITOR_OUTPUT_DIR", str(folder / "monitor_output"))
        torch.manual_seed(0)
        model = Model(gate_class)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        monitor = TrainerMon(str(config)).set_monitor(model, optimizer=optimizer, grad_acc_steps=GA)
        gen = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            for _ in range(GA):
                model(torch.randn(SEQ, BATCH, HIDDEN, generator=gen)).backward()
            optimizer.step()
            optimizer.zero_grad()
        monitor.stop()
    logdir = folder / "watch"
    done = watch_once(monitor.output_dir.parent, "--logdir", logdir)
    assert done.returncode == 0, done.stderr
    with open_run(monitor.output_dir.parent) as data:
        frame = data.records()
    return read_events(logdir), frame, logdir


def test_one_chart_per_layer_and_value_and_the_overviews_worst(run):
    (scalars, every), frame, _ = run
    tags = set(every)
    features = {t for t in tags if t.split("/")[0] in ("attention_hook", "linear_hook", "moe_load")}
    # 3 layers x (3 attention values + 2 linear values (qkv and mlp are one layer's) + 4 MoE values)
    assert len(features) == 3 * (3 + 2 + 4), sorted(features)
    assert not any(t.startswith("moe_expert_load") or ".core" in t or ".qkv" in t for t in tags)
    for step in range(STEPS):
        at = frame[frame.step == step]
        for layer in range(3):
            entropy = at[at.name == f"layers.{layer}.core.entropy"]["min"]
            assert len(entropy) == GA
            assert dict(scalars[f"attention_hook/entropy of layers.{layer}"])[step] == pytest.approx(entropy.min(),
                                                                                                  rel=1e-6)
            kernels = at[(at.family == "linear_hook") & at.name.str.startswith(f"layers.{layer}.")
                         & at.name.str.endswith(".kernel_norm")]["max"]
            assert len(kernels) == 2  # qkv and mlp (TopKGate applies wg.weight without calling wg: no forward)
            assert dict(scalars[f"linear_hook/kernel_norm of layers.{layer}"])[step] == pytest.approx(kernels.max(),
                                                                                                 rel=1e-6)
        imbalance = at[at.name.str.endswith(".imbalance")]["max"]
        assert len(imbalance) == 3
        assert dict(scalars["Worst tensor/moe_load imbalance"])[step] == pytest.approx(imbalance.max(), rel=1e-6)
        entropy = at[at.name.str.endswith(".router_entropy")]["min"]
        assert dict(scalars["Worst tensor/moe_load router_entropy"])[step] == pytest.approx(entropy.min(), rel=1e-6)
        assert 0 < entropy.min() <= math.log(EXPERTS)


def test_the_experts_loads_are_a_layer_x_expert_heatmap(run):
    (_, every), _, logdir = run
    assert "heatmaps/moe_load_layer_x_expert" in every
    assert (logdir / "heatmaps" / "moe_load_layer_x_expert.png").stat().st_size > 0
    assert not any(tag.startswith(("heatmaps/attention_hook", "heatmaps/moe_load_layer_x_step")) for tag in every)
