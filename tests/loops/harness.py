"""The checks every third-party training loop must pass, measured with the tests' own hooks.

`LoopProbe` counts the training forwards of each optimizer step with its own forward pre-hook, reads the
grads the optimizer consumed in a step post-hook (after any closure ran, after clipping), and can
multiply one module's output by Inf at a (step, micro-batch) of its own counting.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest
import torch

from trainmon.cli import main as cli_main

pd = pytest.importorskip("pandas")  # the reader the CSV files are checked with (the `db` extra)

CONFIG = dict(xy_distribution=True, all_xy=True, wg_distribution=True, mv_distribution=True,
              param_distribution=True, ops=["norm", "min", "max", "nans", "infs"], ndigits=17, format=["csv"],
              alert={"rules": [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalySpike"},
                               {"rule_name": "AnomalyPrecursor"}]})
STEP_FAMILIES = ["actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_origin", "param_updated",
                 "exp_avg", "exp_avg_sq"]
INJECTED_STEP, INJECTED_MICRO = 3, 1


class TinyRegressor(torch.nn.Module):
    """A small regression net that returns {"loss", "logits"} as transformers models do."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.act = torch.nn.Tanh()
        self.hidden = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x, labels=None):
        logits = self.head(self.hidden(self.act(self.inp(x)))).squeeze(-1)
        if labels is None:
            return {"logits": logits}
        return {"loss": torch.nn.functional.mse_loss(logits, labels), "logits": logits}


def samples(n: int = 18, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    y = x.sum(-1) * 0.5
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


class LoopProbe:
    """The test's own account of a run: micro-batches per step and the grads each step consumed."""

    def __init__(self, model: torch.nn.Module, inject: Optional[str] = None):
        self.model = model
        self.step = 0
        self.micro = -1
        self.micros: dict[int, int] = {}
        self.consumed: dict[int, dict[str, float]] = {}
        # Never traced into a compiled model: its counters would be guards that recompile every micro-batch.
        model.register_forward_pre_hook(torch._dynamo.disable(self._forward_started))
        if inject is not None:
            dict(model.named_modules())[inject].register_forward_hook(torch._dynamo.disable(self._inject))

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Reads the consumed grads after every step of `optimizer` (the torch optimizer itself)."""
        optimizer.register_step_post_hook(self._stepped)

    def _forward_started(self, module, args):
        if module.training and torch.is_grad_enabled():
            self.micro += 1
            self.micros[self.step] = self.micro + 1

    def _inject(self, module, args, output):
        if (self.step, self.micro) == (INJECTED_STEP, INJECTED_MICRO) and torch.is_grad_enabled():
            return output * float("inf")
        return None

    def _stepped(self, optimizer, args, kwargs):
        self.consumed[self.step] = {name: float(p.grad.norm()) for name, p in self.model.named_parameters()
                                    if p.grad is not None}
        self.step += 1
        self.micro = -1


def read_family(rank_dir: Path, family: str) -> pd.DataFrame:
    files = sorted(f for f in rank_dir.glob(f"{family}_*-*.csv") if f.name[len(family) + 1].isdigit())
    assert files, f"no {family} files in {sorted(p.name for p in rank_dir.iterdir())}"
    return pd.concat([pd.read_csv(f) for f in files], ignore_index=True)


def rank_dir_of(output_dir: Path) -> Path:
    (run,) = output_dir.iterdir()
    return run / "rank_0"


def check_healthy(output_dir: Path, probe: LoopProbe, short_last_step: bool = True) -> None:
    """No anomaly; micro-steps as they ran; grad_reduced as consumed; every family at every step."""
    rank_dir = rank_dir_of(output_dir)
    anomalies = rank_dir / "anomalies.jsonl"
    assert not anomalies.exists() or not anomalies.read_text().strip(), anomalies.read_text()[:2000]
    steps = sorted(probe.consumed)
    assert steps == list(range(len(steps))) and len(steps) >= 6
    if short_last_step:
        assert 1 in {probe.micros[s] for s in steps}, f"no step with one micro-batch: {probe.micros}"
    for family in ("actv", "actv_grad"):
        frame = read_family(rank_dir, family)
        for step in steps:
            assert set(frame[frame.step == step].micro_step) == set(range(probe.micros[step])), (family, step)
        assert set(frame.step) == set(steps), family
        # the same records at every micro-step: none dropped (a loss the loop scales in place included)
        names = frame.groupby(["step", "micro_step"]).name.apply(frozenset)
        assert names.nunique() == 1, names.value_counts()
    for family in STEP_FAMILIES:
        assert set(read_family(rank_dir, family).step) == set(steps), family
    reduced = read_family(rank_dir, "grad_reduced").set_index(["step", "name"]).norm
    for step in steps:
        for name, norm in probe.consumed[step].items():
            assert reduced[(step, name)] == pytest.approx(norm, rel=1e-5), (step, name)


def check_structure(output_dir: Path, model: torch.nn.Module) -> None:
    """The integration wrote the module tree for the structure view: every module, in model order, with its class."""
    struct = json.loads((rank_dir_of(output_dir) / "module_struct.json").read_text())
    assert [(key.partition(":")[2], info["class"]) for key, info in struct.items()] == \
        [(name, type(module).__name__) for name, module in model.named_modules()]


def check_injected(output_dir: Path, module: str, capsys) -> None:
    """The online alert and nan-analyze name the injected (step, micro-batch, module, forward output)."""
    expected = {"rank": 0, "step": INJECTED_STEP, "micro_step": INJECTED_MICRO, "module": module,
                "phase": "forward", "tensor": "output"}
    records = [json.loads(line) for line in open(rank_dir_of(output_dir) / "anomalies.jsonl")]
    # each step batch names its own first; the Trainer's logged scalars come in batches of their own, after
    first = min((r for r in records if r["first"]),
                key=lambda r: (r["step"], r["micro_step"] if r["micro_step"] is not None else float("inf")))
    assert {k: first[k] for k in expected} == expected, first
    capsys.readouterr()
    assert cli_main(["nan-analyze", str(output_dir), "--json"]) == 1  # 1: found
    report = json.loads(capsys.readouterr().out)
    assert {k: report["first"][k] for k in expected} == expected, report["first"]
