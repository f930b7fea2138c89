"""MoE load (`moe_load`) from DeepSpeed's own TopKGate in one process: the tokens per expert equal the gate's own
dispatch mask summed over the step's micro-steps, the layer figures follow from them, dropped tokens from the counts
the gate returns beside the mask, and the tap reads nothing on the host. Megatron-Core's TopKRouter and the merge
over expert-parallel ranks are tested on real jobs (tests/distributed/test_moe_load_jobs.py)."""
import math

import pytest
import torch

from op_log import Ops
from trainmon import TrainerMon, open_run

EXPERTS, HIDDEN, TOKENS, GA, STEPS = 4, 16, 24, 2, 3


def gate_model():
    sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # capacity 0.5 x tokens / experts: most routes are dropped
            self.gate = sharded_moe.TopKGate(HIDDEN, EXPERTS, k=1, capacity_factor=0.5, min_capacity=1)
            self.lin = torch.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            l_aux, combine, _, _ = self.gate(x)
            return self.lin(x).square().mean() + l_aux + combine.sum()

    torch.manual_seed(0)
    return Model()


def train_gate(model, write_config, wrap=None) -> dict:
    """STEPS steps of GA micro-batches of `model` (trained through `wrap(model)` where given) with moe_load on;
    what the run wrote (`_written`)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    monitor = TrainerMon(write_config(moe_load=True, format=["db"], ops=["max"]))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=GA)
    run_model = model if wrap is None else wrap(model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for _ in range(GA):
            run_model(torch.randn(TOKENS, HIDDEN, generator=gen)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _written(monitor)


def test_the_load_is_the_gates_own_decision(output_dir, write_config):
    model = gate_model()
    seen = []  # per forward: tokens per expert after the drop, routes before it, the logits
    model.gate.register_forward_hook(lambda m, args, out: seen.append(
        (out[2].sum(dim=(0, 2)).double(), float(out[3].sum()), (args[0] @ m.wg.weight.t()).detach())))
    written = train_gate(model, write_config)
    dropped_somewhere = False
    for step in range(STEPS):
        forwards = seen[step * GA:(step + 1) * GA]
        load = sum(f[0] for f in forwards)
        routed = sum(f[1] for f in forwards)
        probs = torch.cat([f[2] for f in forwards]).softmax(-1)
        entropy = float(-(probs * probs.log()).sum(-1).mean())
        for e in range(EXPERTS):
            assert written[("moe_expert_load", f"gate.expert_{e}", step)] == float(load[e])
        assert written[("moe_load", "gate.imbalance", step)] == pytest.approx(float(load.max() / load.mean()))
        assert written[("moe_load", "gate.idle_experts", step)] == float((load == 0).sum())
        assert written[("moe_load", "gate.dropped_tokens", step)] == routed - float(load.sum())
        assert written[("moe_load", "gate.router_entropy", step)] == pytest.approx(entropy, rel=1e-5)
        dropped_somewhere |= routed > float(load.sum())
    assert dropped_somewhere
    assert not any(math.isnan(v) for v in written.values())



def test_a_gate_inside_a_compiled_region_records_the_eager_load(output_dir, write_config, tmp_path, monkeypatch):
    eager = train_gate(gate_model(), write_config)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "compiled"))
    compiled = train_gate(gate_model(), write_config, wrap=lambda model: torch.compile(model, backend="aot_eager"))
    assert len(eager) == STEPS * (EXPERTS + 4) and compiled == eager

def test_the_tap_reads_nothing_on_the_host(output_dir, write_config):
    model = gate_model()
    x = torch.randn(TOKENS, HIDDEN)
    with Ops() as plain:
        model(x)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    monitor = TrainerMon(write_config(moe_load=True, format=["db"], ops=["max"]))
    monitor.set_monitor(model, optimizer=optimizer)
    with Ops() as tapped:
        model(x)
    model(x).backward()
    optimizer.step()
    monitor.stop()
    added = tapped.counts - plain.counts
    assert added and "aten._local_scalar_dense" not in added and "aten.item" not in added, added
    with Ops() as after:  # stop() took the hook off
        model(x)
    assert after.counts == plain.counts


def megatron_router_layer(pad: bool = False) -> torch.nn.Module:
    """A layer holding a router that routes as Megatron-Core's `TopKRouter.routing` does, single process."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    import types

    config = types.SimpleNamespace(num_moe_experts=EXPERTS, moe_expert_capacity_factor=1.0,
                                   moe_pad_expert_input_to_capacity=pad)

    class TopKRouter(torch.nn.Module):  # Megatron-Core's routing of `TopKRouter.routing`, single process
        def __init__(self):
            super().__init__()
            self.config, self.topk = config, 2
            self.weight = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN))
            self.bias = torch.zeros(EXPERTS)
            self.bias[0] = 3.0  # expert 0 favoured: its routes are dropped

        def routing(self, logits):
            probs, routing_map = moe_utils.topk_routing_with_score_function(logits, self.topk, use_pre_softmax=False,
                                                                            score_function="softmax")
            return moe_utils.apply_router_token_dropping(probs, routing_map, router_topk=self.topk,
                                                         capacity_factor=1.0, pad_to_capacity=pad)

        def forward(self, x):
            return self.routing(x @ self.weight.t() + self.bias)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = TopKRouter()

        def forward(self, x):
            return self.router(x)

    torch.manual_seed(0)
    return Layer()


@pytest.mark.parametrize("pad", [False, True])
def test_megatron_routing_padded_to_capacity_counts_the_tokens_not_the_padding(output_dir, write_config, pad):
    """Megatron-Core's routing with a capacity, its experts' inputs padded to capacity or not: the routing map padded
    holds every expert's capacity slots, and the load is still the tokens each expert received."""
    model = megatron_router_layer(pad)
    seen = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(moe_load=True, format=["db"], ops=["max"])).set_monitor(model,
                                                                                              optimizer=optimizer)
    for _ in range(2):
        probs, routing_map = model(torch.randn(TOKENS, HIDDEN))
        seen.append((routing_map & (probs != 0)).sum(dim=0).double())
        (probs.sum() + model.router.weight.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    written = _written(monitor)
    for step, load in enumerate(seen):
        assert [written[("moe_expert_load", f"router.expert_{e}", step)] for e in range(EXPERTS)] == load.tolist()
        assert written[("moe_load", "router.imbalance", step)] == pytest.approx(float(load.max() / load.mean()))
        assert written[("moe_load", "router.dropped_tokens", step)] == TOKENS * 2 - float(load.sum()) > 0
    assert load.max() > load.min()  # unequal loads, which the padding would hide


def _written(monitor) -> dict:
    """{(family, name, step): max} of what a stopped monitor's run wrote."""
    monitor.stop()
    with open_run(monitor.output_dir.parent) as run:
        frame = run.records()
    return {(r.family, r.name, int(r.step)): r.max for r in frame.itertuples()}


def test_a_router_inside_a_compiled_region_records_no_load_and_says_so(output_dir, write_config, caplog):
    """Megatron's routing compiled after trainmon was attached counts no forward: no zeros are written for it (they
    would read as every expert idle), and one message says why."""
    model = megatron_router_layer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(moe_load=True, format=["db"], ops=["max"])).set_monitor(model,
                                                                                              optimizer=optimizer)
    compiled = torch.compile(model, backend="aot_eager")
    with caplog.at_level("WARNING", logger="trainmon"):
        for _ in range(2):
            probs, _ = compiled(torch.randn(TOKENS, HIDDEN))
            (probs.sum() + model.router.weight.sum()).backward()
            optimizer.step()
            optimizer.zero_grad()
        monitor.stop()
    with open_run(monitor.output_dir.parent) as run:
        records = run.records()
    assert not records.family.isin(["moe_load", "moe_expert_load"]).any()
    said = [r.getMessage() for r in caplog.records if "ran no counted training forward" in r.getMessage()]
    assert len(said) == 1 and "router router" in said[0] and "step 0" in said[0]
