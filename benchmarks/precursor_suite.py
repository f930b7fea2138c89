"""The precursor suite: AnomalyPrecursor, the early warning, on healthy runs and on constructed divergences.

The spike suite's transformer (benchmarks/spike_suite.py: 4 blocks, hidden 32, warm-up + cosine, 300 steps), its
attention computed from q and k by a module of its own (so that the L2 attention features see them), with
QK-LayerNorm on q and k as in current large models. Each run records the attention features, the weights and Adam's
update (with `--optimizer sgd`, SGD with momentum 0.9, which has none), and logs the loss and the learning rate,
with AnomalyPrecursor as its rule:

- healthy: warm-up + cosine, with and without QK-LayerNorm, several seeds: every warning is a false alarm;
- lr ramp: from `--ramp-start` the learning rate climbs x50 over 100 steps (geometrically) from where the schedule
  had it, and is held there; with and without QK-LayerNorm. (Without QK-LayerNorm and nothing else, up to 30 times
  the learning rate, attention logits grow 60-fold and the model still learns: no divergence to warn of.)

For a divergence it reports the first warning (step, signal, module, rate) against the first loss spike
(`trainmon.demo.first_loss_spike`) and the first NaN/Inf loss: by how many steps the warning came first.
`tests/test_anomaly_precursor.py` runs its short form.

    python benchmarks/precursor_suite.py --seeds 3
    python benchmarks/precursor_suite.py --seeds 3 --optimizer sgd
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainmon.demo import first_loss_spike, first_nonfinite

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spike_suite import BATCH, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, Mlp, Model  # noqa: E402

STEPS, WARMUP_FRACTION = 300, 0.1
RULES = [{"rule_name": "AnomalyPrecursor"}]  # the early warning alone: what is measured here
CONFIG = dict(targets={}, param_distribution=True, ur_distribution=True, recording_l2_features=True,
              l2_targets={"attention_hook": [f"layers.{i}.attn.core" for i in range(LAYERS)]},
              sa_order="b,s,h,d", ops=["min", "max", "norm", "nans", "infs"], format=["db"], alert={"rules": RULES})
# optimizer -> (its make from the parameters, at the peak learning rate; its config: SGD has no Adam update, so
# its update ratio is not watched)
OPTIMIZERS = {
    "adamw": (lambda params: torch.optim.AdamW(params, lr=3e-3), CONFIG),
    "sgd": (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            {k: v for k, v in CONFIG.items() if k != "ur_distribution"}),
}


class Core(nn.Module):
    """Causal attention of q, k, v given as [b, s, h, d] (sa_order "b,s,h,d")."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, qk_norm: bool):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.core = Core()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, self.head_dim)).unbind(-3)
        return self.proj(self.core(self.q_norm(q), self.k_norm(k), v).flatten(-2))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, qk_norm: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, qk_norm)
        self.mlp = Mlp(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def model_of(qk_norm: bool = True) -> Model:
    return Model(lambda: Block(HIDDEN, HEADS, qk_norm))


def lr_factor(step: int, steps: int, ramp_start: Optional[int]) -> float:
    """The learning rate's factor at `step`: linear warm-up over the first 10%, then cosine decay to 0; from
    `ramp_start` (when given) x50 over 100 steps, geometrically, from where the schedule had it, and held there."""
    warmup = max(1, int(steps * WARMUP_FRACTION))
    if step < warmup:
        return 0.01 + 0.99 * step / warmup
    ramp = 50 ** (min(step - ramp_start, 100) / 100) if ramp_start is not None and step >= ramp_start else 1.0
    step = min(step, ramp_start) if ramp_start is not None else step
    return ramp * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train(config_path: Optional[str], steps: int = STEPS, seed: int = 0, qk_norm: bool = True,
          ramp_start: Optional[int] = None, optimizer: str = "adamw") -> dict:
    """Trains `steps` steps of `optimizer` (OPTIMIZERS) under trainmon (no monitor without `config_path`). Returns
    {"losses", "anomalies", "run"}; training stops at the first non-finite loss."""
    torch.manual_seed(seed)
    model = model_of(qk_norm)
    optimizer = OPTIMIZERS[optimizer][0](model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, steps, ramp_start))
    monitor = None
    if config_path is not None:
        from trainmon import TrainerMon
        monitor = TrainerMon(config_path).set_monitor(model, optimizer=optimizer)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
        stride = torch.randint(1, 4, (BATCH, 1), generator=gen)
        tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        if monitor is not None:
            monitor.log_scalar("loss", loss.detach())
            monitor.log_scalar("lr", optimizer.param_groups[0]["lr"])  # the update-to-weight ratio's
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            break
    out = {"losses": losses, "anomalies": [], "run": None}
    if monitor is not None:
        monitor.stop()
        path = monitor.output_dir / "anomalies.jsonl"
        out["anomalies"] = [json.loads(line) for line in open(path)] if path.exists() else []
        out["run"] = monitor.output_dir.parent
    return out


def run(steps: int = STEPS, seed: int = 0, qk_norm: bool = True, ramp_start: Optional[int] = None,
        optimizer: str = "adamw") -> dict:
    """`train` under the optimizer's config, in a fresh output directory."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(OPTIMIZERS[optimizer][1]))
        os.environ["MONITOR_OUTPUT_DIR"] = str(Path(tmp) / "monitor_output")
        return train(str(config), steps, seed, qk_norm, ramp_start, optimizer)


def warnings_of(anomalies: list[dict]) -> list[dict]:
    return [a for a in anomalies if a["rule"] == "AnomalyPrecursor"]


def lead(result: dict) -> dict:
    """The first warning and how many steps it came before the first loss spike and the first NaN/Inf loss."""
    warned = warnings_of(result["anomalies"])
    first = min(warned, key=lambda a: a["step"]) if warned else None
    spike, nonfinite = first_loss_spike(result["losses"]), first_nonfinite(result["losses"])
    return {"warning": None if first is None else first["step"],
            "said": None if first is None else f"{first['module']} {first['tensor']}: {first['op']}",
            "loss_spike": spike, "nonfinite": nonfinite,
            "before_spike": None if first is None or spike is None else spike - first["step"],
            "before_nonfinite": None if first is None or nonfinite is None else nonfinite - first["step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--ramp-start", type=int, default=150)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    args = parser.parse_args()
    torch.set_num_threads(1)
    begun = time.time()
    for seed in range(args.seeds):
        for qk_norm in (True, False):
            result = run(args.steps, seed, qk_norm, optimizer=args.optimizer)
            print(f"healthy seed {seed} qk_norm {qk_norm}: loss {result['losses'][0]:.3f} -> "
                  f"{result['losses'][-1]:.3f}, warnings {len(warnings_of(result['anomalies']))}", flush=True)
    for seed in range(args.seeds):
        for name, kwargs in (("lr ramp x50", dict(ramp_start=args.ramp_start)),
                             ("lr ramp x50, no qk norm", dict(ramp_start=args.ramp_start, qk_norm=False))):
            print(f"{name} seed {seed}: {lead(run(args.steps, seed, optimizer=args.optimizer, **kwargs))}",
                  flush=True)
    print(f"{time.time() - begun:.0f} s", flush=True)


if __name__ == "__main__":
    main()
