"""The spike suite: a small transformer trained under a learning-rate warm-up and cosine decay, with a spike
put into one module's forward output at one step; the online processor's alerts and the record it names first.

The benchmark (`python benchmarks/spike_suite.py`) reports the smallest spike factor that is detected and
named at its own forward output, and the false-alarm rate of healthy runs; tests/test_anomaly_spike_origin.py
runs the suite's short form.

    python benchmarks/spike_suite.py --steps 300 --factors 1.5 2 3 4 5 10 20 --healthy-steps 10000
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

SPIKE_MODULE = "layers.2.mlp"
VOCAB, SEQ, BATCH, HIDDEN, LAYERS, HEADS = 64, 16, 4, 32, 4, 4
CONFIG = dict(targets={}, all_xy=True, xy_distribution=True, wg_distribution=True, param_distribution=True,
              mv_distribution=True, ops=["norm", "nans", "infs"], format="csv", sentinel=True,
              alert={"rules": [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalySpike"}]})


class Mlp(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = Mlp(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    """The suite's model: LAYERS blocks that `block()` makes (default: this suite's `Block`)."""

    def __init__(self, block=lambda: Block(HIDDEN, HEADS)):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def train(config_path: str, steps: int, seed: int = 0, spike_step: Optional[int] = None,
          factor: float = 1.0) -> list[dict]:
    """Trains `steps` AdamW steps (10% linear warm-up, then cosine decay) under trainmon; with `spike_step`,
    SPIKE_MODULE's forward output is multiplied by `factor` at that step. Returns the anomalies written."""
    torch.manual_seed(seed)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warmup_steps = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=warmup_steps),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps - warmup_steps)], milestones=[warmup_steps])
    step = 0
    # registered before the monitor's hooks, so the monitor records the spiked output
    model.get_submodule(SPIKE_MODULE).register_forward_hook(
        lambda module, inputs, output: output * factor if step == spike_step else None)
    from trainmon import TrainerMon
    monitor = TrainerMon(config_path)
    monitor.set_monitor(model, optimizer=optimizer)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
        stride = torch.randint(1, 4, (BATCH, 1), generator=gen)
        tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    monitor.stop()
    path = monitor.output_dir / "anomalies.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def first_named(anomalies: list[dict], step: int) -> Optional[tuple]:
    """(module, phase, tensor) of the record named first at `step`, or None."""
    return next(((a["module"], a["phase"], a["tensor"]) for a in anomalies if a["step"] == step and a["first"]), None)


def run(steps: int, seed: int = 0, spike_step: Optional[int] = None, factor: float = 1.0) -> list[dict]:
    """`train` under CONFIG, in a fresh output directory."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(CONFIG))
        os.environ["MONITOR_OUTPUT_DIR"] = str(Path(tmp) / "monitor_output")
        return train(str(config), steps, seed, spike_step, factor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps of a run")
    parser.add_argument("--spike-step", type=int, default=250)
    parser.add_argument("--factors", type=float, nargs="+", default=[1.5, 2, 3, 4, 5, 10, 20])
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the spiked runs, per factor")
    parser.add_argument("--healthy-steps", type=int, default=10_000, help="healthy steps in all")
    args = parser.parse_args()
    torch.set_num_threads(1)
    origin = (SPIKE_MODULE, "forward", "output")
    named_right = set()
    for factor in sorted(args.factors):
        right = 0
        for seed in range(args.seeds):
            anomalies = run(args.steps, seed, args.spike_step, factor)
            named = first_named(anomalies, args.spike_step)
            before = sorted({a["step"] for a in anomalies if a["step"] < args.spike_step})
            after = sorted({a["step"] for a in anomalies if a["step"] > args.spike_step})
            right += named == origin and not before
            print(f"x{factor:g} seed {seed}: named first {named}; alerts before the spike {before}, "
                  f"after it {after}", flush=True)
        if right == args.seeds:
            named_right.add(factor)
    smallest = min((f for f in named_right if all(g in named_right for g in args.factors if g >= f)), default=None)
    print(f"smallest factor detected and named at {SPIKE_MODULE} forward output, it and every larger one in "
          f"all {args.seeds} seeds: {'none' if smallest is None else f'x{smallest:g}'}", flush=True)
    done, alerting, runs, begun = 0, 0, 0, time.time()
    while done < args.healthy_steps:
        steps = min(args.steps, args.healthy_steps - done)
        alerting += len({a["step"] for a in run(steps, seed=1000 + runs)})
        done, runs = done + steps, runs + 1
    print(f"false alarms: {alerting} alerting steps in {done} healthy steps ({runs} runs of up to {args.steps} "
          f"steps, seeds 1000-{999 + runs}; the rule judges from a series' 11th value): "
          f"{alerting / done:.1e} a step, {time.time() - begun:.0f} s")


if __name__ == "__main__":
    main()
