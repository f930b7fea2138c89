"""The demo job: a small GPT-style model trained on synthetic sequences with trainmon enabled.

Run with `trainmon demo` (embedded config) or `python scripts/train_demo.py --config configs/demo.json`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainmon.core.records import GRAD_REDUCED
from trainmon.read.errors import InputError
from trainmon.watch.spawn import WATCH_DIR, watch_logdir

# The embedded default config; configs/demo.json holds the same keys (a test keeps them equal). Training
# writes only the database, the cheapest sink; the daemon (`watch`) makes the TensorBoard view from it.
DEMO_CONFIG = {
    "targets": {},
    "all_xy": True,
    "xy_distribution": True,
    "wg_distribution": True,
    "param_distribution": True,
    "mv_distribution": True,
    "ops": ["min", "max", "norm", "mean", "zeros", "nans", "infs"],
    "format": ["db"],
    "start_step": 0,
    "step_interval": 1,
    "sentinel": True,
    "print_struct": True,
    "alert": {"rules": [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalySpike"},
                        {"rule_name": "AnomalyPrecursor"}]},
    "watch": {"enable": True, "interval": 1, "heatmap_every": 100},
}
# `--inject nan`: where the Inf goes (a module of TinyGPT, and the step as a fraction of the run)
INJECT_MODULE = "layers.1.mlp.0"
INJECT_AT = 0.5
# `--inject instability`: from INJECT_AT of the run the learning rate climbs x RAMP_FACTOR over RAMP_STEPS steps
# (geometrically), and stays there
RAMP_FACTOR, RAMP_STEPS = 50, 100
# A loss spike: the loss above SPIKE_FACTOR x the median of its previous SPIKE_WINDOW values (or not finite)
SPIKE_FACTOR, SPIKE_WINDOW = 2.0, 20
WATCH_WAIT_S = 300


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A causal language model: token + position embeddings, pre-norm blocks, a linear head."""

    def __init__(self, vocab: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4, seq: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def synthetic_batch(gen: torch.Generator, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up from a random start with a random stride: learnable, never ending."""
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def inject_inf(model: nn.Module, module_name: str, step: int, current_step) -> None:
    """Puts +Inf into element [0, 0, 0] of `module_name`'s output at `step` (`current_step()` tells the step).
    Registered before the monitor's hooks, so the monitor sees the Inf."""

    def hook(module, inputs, output):
        if current_step() != step:
            return None
        output = output.clone()
        output[0, 0, 0] = float("inf")
        return output

    model.get_submodule(module_name).register_forward_hook(hook)


def ramped(step: int, start: Optional[int]) -> float:
    """The learning rate's factor at `step` under `--inject instability` from `start` (1 before it, or without)."""
    return 1.0 if start is None else RAMP_FACTOR ** (min(max(step - start, 0), RAMP_STEPS) / RAMP_STEPS)


def first_loss_spike(losses: list[float]) -> Optional[int]:
    """The first step whose loss is not finite or above SPIKE_FACTOR x the median of its previous SPIKE_WINDOW."""
    return next((step for step in range(SPIKE_WINDOW, len(losses)) if not math.isfinite(losses[step]) or
                 losses[step] > SPIKE_FACTOR * statistics.median(losses[step - SPIKE_WINDOW:step])), None)


def first_nonfinite(losses: list[float]) -> Optional[int]:
    return next((step for step, loss in enumerate(losses) if not math.isfinite(loss)), None)


def train(steps: int, config_path: Optional[str], seed: int = 0, grad_acc_steps: int = 1, batch: int = 8,
          seq: int = 32, vocab: int = 256, hidden: int = 64, layers: int = 2, lr: float = 3e-3,
          log_every: int = 50, inject_step: Optional[int] = None, ramp_step: Optional[int] = None):
    """Trains TinyGPT; with a config, under trainmon; with `inject_step`, an Inf enters INJECT_MODULE there; with
    `ramp_step`, the learning rate climbs from there (`ramped`).

    Returns:
        (losses, the stopped TrainerMon or None).
    """
    torch.manual_seed(seed)
    model = TinyGPT(vocab=vocab, hidden=hidden, layers=layers, seq=seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: ramped(s, ramp_step))
    gen = torch.Generator().manual_seed(seed + 1)
    step = 0
    if inject_step is not None:
        inject_inf(model, INJECT_MODULE, inject_step, lambda: step)
    monitor = None
    if config_path is not None:
        from trainmon.trainer_mon import TrainerMon
        monitor = TrainerMon(config_path)
        monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=grad_acc_steps)
    losses = []
    start = time.time()
    for step in range(steps):
        total = torch.zeros(())
        for _ in range(grad_acc_steps):
            tokens, labels = synthetic_batch(gen, batch, seq, vocab)
            loss = lm_loss(model, tokens, labels) / grad_acc_steps
            loss.backward()
            total += loss.detach()
        if monitor is not None:
            monitor.log_scalar("loss", total)
            monitor.log_scalar("lr", optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  ({time.time() - start:.1f}s)", flush=True)
    if monitor is not None:
        monitor.stop()
    return losses, monitor


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    at = int(args.steps * INJECT_AT)
    inject_step = at if args.inject == "nan" else None
    ramp_step = at if args.inject == "instability" else None
    if inject_step is not None:
        print(f"injecting +Inf into {INJECT_MODULE}'s output at step {inject_step}")
    if ramp_step is not None:
        print(f"ramping the learning rate x{RAMP_FACTOR} over {RAMP_STEPS} steps from step {ramp_step}")
    with _config_file(args.config) as config_path:
        losses, monitor = train(args.steps, config_path, grad_acc_steps=args.grad_acc_steps, inject_step=inject_step,
                                ramp_step=ramp_step)
    print(f"\ntrained {len(losses)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}"
          f"{'' if math.isfinite(losses[-1]) else ' (non-finite!)'}")
    run_dir = monitor.output_dir.parent
    print(f"monitor output: {run_dir}")
    watched = monitor.watch_process is not None
    logdir = watch_logdir(run_dir, monitor.config.watch)
    if watched:
        _wait_for(monitor.watch_process, logdir)
    if inject_step is not None:
        _show_injection(run_dir, logdir if watched else None)
    if ramp_step is not None:
        _show_early_warning(monitor.output_dir, losses)
    print("\nnext steps:")
    for number, (command, note) in enumerate(next_steps(run_dir, logdir, watched), 1):
        print(f"  {number}. {command}      # {note}")
    return 0


def next_steps(run_dir: Path, logdir: Path, watched: bool) -> list[tuple[str, str]]:
    """(command, what it gives) of each next step on this run, as its config made it: the daemon's view when it
    ran (else the command that makes it), and a table of a step that was collected."""
    try:
        collected = _last_collected(run_dir)
    except InputError as err:  # the config's formats write nothing the read layer reads (tensorboard, api)
        return [(f"tensorboard --logdir {run_dir}", f"the ranks' own event files ({err})")]
    out = []
    if not watched:
        option = "" if logdir == run_dir / WATCH_DIR else f" --logdir {logdir}"
        out.append((f"trainmon watch {run_dir} --once{option}", "the view of every rank (the config has no watch)"))
    out += [(f"tensorboard --logdir {logdir}", "opens on Overview (loss, grad norm, lr, NaN/Inf counts, the first "
                                               "NaN/Inf's rank); one chart per layer, heatmaps (images), alerts and "
                                               "where the first NaN/Inf is (text), the module tree (trainmon "
                                               "structure)"),
            (f"trainmon nan-analyze {run_dir}", "where a NaN/Inf first appeared")]
    if collected is None:
        out.append((f"trainmon show {run_dir} --scalars", "no step was collected (start_step, step_interval, "
                                                         "collect_times): the logged scalars"))
    else:
        family, step = collected
        out.append((f"trainmon show {run_dir} --family {family} --steps {step}", "the figures as a table"))
    return out


def _last_collected(run_dir: Path) -> Optional[tuple[str, int]]:
    """(family, step) of the newest step with records, of grad_reduced when the run has it; None when no step has.

    Raises:
        InputError: the run holds nothing the read layer reads.
    """
    from trainmon.read import open_run
    with open_run(run_dir) as run:
        records = run.records()[["family", "step"]]
    if records.empty:
        return None
    family = GRAD_REDUCED if (records.family == GRAD_REDUCED).any() else records.family.iloc[-1]
    return family, int(records.step[records.family == family].max())


@contextlib.contextmanager
def _config_file(path: Optional[str]) -> Iterator[str]:
    """`path`, or the embedded config in a file that lives as long as the run."""
    if path is not None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="trainmon_demo_") as folder:
        path = os.path.join(folder, "config.json")
        with open(path, "w") as handle:
            json.dump(DEMO_CONFIG, handle)
        yield path


def _wait_for(watch, logdir: Path) -> None:
    """Waits for the daemon's last round (it exits once the run has finished and is exported)."""
    try:
        watch.wait(timeout=WATCH_WAIT_S)
    except subprocess.TimeoutExpired:
        print(f"trainmon watch is still running after {WATCH_WAIT_S} s (pid {watch.pid}); see {logdir}/watch.log")
        return
    if watch.returncode:
        print(f"trainmon watch exited with status {watch.returncode}; see {logdir}/watch.log")


def _show_injection(run_dir: Path, logdir: Optional[Path]) -> None:
    """The daemon's alert (`logdir`: where it wrote; None: it did not run) and nan-analyze's answer."""
    from trainmon.analysis.nan_analyze import analyze, describe_place
    from trainmon.watch.alerts import ALERTS_FILE
    if logdir is not None:
        alerts_path = logdir / ALERTS_FILE
        alerts = []
        if alerts_path.exists():
            with open(alerts_path, encoding="utf-8") as fh:
                alerts = [json.loads(line) for line in fh if line.strip()]
        if alerts:
            print(f"trainmon watch alerted ({alerts_path}):\n  {alerts[-1]['message']}")
        else:
            print(f"trainmon watch wrote no alert ({alerts_path})")
    first = analyze(run_dir)["first"]
    print(f"trainmon nan-analyze {run_dir}:\n  first non-finite tensor: "
          f"{describe_place(first) if first else 'none'}")


def _show_early_warning(rank_dir: Path, losses: list[float]) -> None:
    """AnomalyPrecursor's first warning of the rank, against the first loss spike and NaN."""
    from trainmon.core.events import PRECURSOR_RULE, AnomalyEvent
    from trainmon.core.layout import ANOMALIES_FILE
    path = rank_dir / ANOMALIES_FILE
    events = [AnomalyEvent.from_json(json.loads(line)) for line in open(path, encoding="utf-8")] \
        if path.exists() else []
    warned = [e for e in events if e.rule == PRECURSOR_RULE]
    spike, nonfinite = first_loss_spike(losses), first_nonfinite(losses)
    spiked = "no loss spike" if spike is None else f"the loss first spiked at step {spike}"
    nan = "" if nonfinite is None else f", and was first NaN/Inf at step {nonfinite}"
    if not warned:
        print(f"no early warning (AnomalyPrecursor) in {path}; {spiked}{nan}")
        return
    first = min(warned, key=lambda e: e.step)
    lead = "" if spike is None else f", {spike - first.step} steps after the warning"
    print(f"early warning (AnomalyPrecursor, {len(warned)} series in all):\n  {first.describe()}\n"
          f"  {spiked}{lead}{nan}")
