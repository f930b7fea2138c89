"""The cost of each L2 feature hook and of the MoE load, as the step time they add to a run without monitoring.

Model: the benchmark model's shape (4 causal blocks, hidden 256, seq 128, batch 8, vocab 1024, AdamW, fp32, one
thread), its attention computed by a module of q, k and v (`precursor_suite.Core`, what `attention_hook` reads), and
in each block a DeepSpeed TopKGate routing the MLP's output over 8 experts' gates (what `moe_load` and the router
hooks read; without DeepSpeed, a linear router). Every configuration is attached in turn to the same model in one
process (`stop()` takes it off again), in rounds, so that a busy machine disturbs them alike; a configuration's
figure is the median over its rounds of the median step time (process CPU, the writer thread's included, and wall)
over the steps after its first. Only the features are on: `format` api, no statistic family. Then the host time of
each feature's computation per call on this model's tensors, which the run's noise does not blur.

    python benchmarks/l2_feature_cost.py --steps 12 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from precursor_suite import Core  # noqa: E402

VOCAB, SEQ, BATCH, HIDDEN, LAYERS, HEADS, EXPERTS = 1024, 128, 8, 256, 4, 4, 8
CORES = [f"layers.{i}.core" for i in range(LAYERS)]
ROUTERS = [f"layers.{i}.router" for i in range(LAYERS)]
CONFIGS = {
    "none": None,
    "attention_hook": {"attention_hook": CORES},
    "linear_hook (every linear)": {"linear_hook": []},
    "moe_router_weight_hook": {"moe_router_weight_hook": ROUTERS},
    "moe_router_logit_hook": {"moe_router_logit_hook": ROUTERS},
    "moe_load": "moe_load",
}


class Block(nn.Module):
    def __init__(self, gate_class):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.core = Core()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        # the router whose logits and weight the router hooks read; under DeepSpeed a TopKGate beside it for moe_load
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.gate = gate_class(HIDDEN, EXPERTS, k=1, capacity_factor=2.0, min_capacity=1) if gate_class else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (3, HEADS, HIDDEN // HEADS)).unbind(-3)
        x = x + self.proj(self.core(q, k, v).flatten(-2))
        h = self.ln2(x)
        scale = self.router(h).softmax(-1).max(-1, keepdim=True).values
        if self.gate is not None:
            _, combine, _, _ = self.gate(h.reshape(-1, HIDDEN))
            scale = scale + combine.sum(dim=(1, 2)).reshape(scale.shape)
        return x + scale * self.fc2(F.gelu(self.fc1(h)))


class Model(nn.Module):
    def __init__(self, gate_class):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(gate_class) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def config_of(name: str) -> dict | None:
    spec = CONFIGS[name]
    if spec is None:
        return None
    base = {"targets": {}, "format": ["api"], "ops": ["max"], "sa_order": "b,s,h,d"}
    if spec == "moe_load":
        return {**base, "moe_load": True}
    return {**base, "recording_l2_features": True, "l2_targets": spec}


def timed_steps(model, optimizer, config: dict | None, steps: int, folder: str) -> tuple[float, float]:
    """(median CPU ms, median wall ms) per step after the first, under `config`."""
    from trainmon import TrainerMon

    monitor = None
    if config is not None:
        path = os.path.join(folder, "config.json")
        with open(path, "w") as handle:
            json.dump(config, handle)
        monitor = TrainerMon(path).set_monitor(model, optimizer=optimizer)
    gen = torch.Generator().manual_seed(1)
    cpu, wall = [], []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start_wall)
    if monitor is not None:
        monitor.stop()
    return 1e3 * statistics.median(cpu[1:]), 1e3 * statistics.median(wall[1:])


def per_call_us() -> dict[str, float]:
    """Host time per call (µs, one thread) of each feature's computation on this model's tensors, and of making the
    records of a call's values: what a hooked call adds, without the run's noise."""
    from trainmon.engine import stats
    from trainmon.hooks import features

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(BATCH, SEQ, HEADS, HIDDEN // HEADS, generator=gen) for _ in range(2))
    weight, router = torch.randn(4 * HIDDEN, HIDDEN, generator=gen), torch.randn(EXPERTS, HIDDEN, generator=gen)
    logits = torch.randn(SEQ * BATCH, EXPERTS, generator=gen)
    start = features.power_iteration_start(HIDDEN, torch.device("cpu"))
    values = features.attention_features(q, k, "b,s,h,d")
    fields = stats.fields_for_ops(["max"])
    calls = {"attention_features (one head of one sequence)": lambda: features.attention_features(q, k, "b,s,h,d"),
             f"stable_rank of a {4 * HIDDEN}x{HIDDEN} weight": lambda: features.stable_rank(weight, start),
             "router_weight_similarity": lambda: features.router_weight_similarity(router),
             "per_token_expert_entropy": lambda: features.per_token_expert_entropy(logits),
             "records of a call's 3 values": lambda: stats.tensor_records(list(values.unbind()), 1e-8, fields)}
    out = {}
    for name, call in calls.items():
        for _ in range(10):
            call()
        begun = time.perf_counter()
        for _ in range(100):
            call()
        out[name] = (time.perf_counter() - begun) * 1e4
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        from deepspeed.moe.sharded_moe import TopKGate
    except ImportError:
        TopKGate = None
    names = args.configs.split(",")
    if TopKGate is None:
        names = [n for n in names if n != "moe_load"]
    torch.manual_seed(0)
    model = Model(TopKGate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    results: dict[str, list] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as folder:
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(folder, "monitor_output")
        for _ in range(args.rounds):
            for name in names:
                results[name].append(timed_steps(model, optimizer, config_of(name), args.steps, folder))
    base_cpu = statistics.median(r[0] for r in results["none"]) if "none" in results else None
    print(f"{'configuration':30s} {'cpu ms/step':>12s} {'wall ms/step':>13s} {'cpu vs none':>12s}")
    for name, rounds in results.items():
        cpu, wall = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
        ratio = f"{cpu / base_cpu:.3f}" if base_cpu else "-"
        print(f"{name:30s} {cpu:12.1f} {wall:13.1f} {ratio:>12s}")
    print("\nper call (host µs):")
    for name, micros in per_call_us().items():
        print(f"  {name:48s} {micros:8.0f}")


if __name__ == "__main__":
    main()
