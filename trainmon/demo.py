"""The demo job: a small GPT-style model trained on synthetic sequences with trainmon enabled.

Run with `trainmon demo` (embedded config) or `python scripts/train_demo.py --config configs/demo.json`.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import tempfile
import time
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainmon.commands.arguments import positive_int

# The embedded default config; configs/demo.json holds the same keys (a test keeps them equal).
DEMO_CONFIG = {
    "targets": {},
    "all_xy": True,
    "xy_distribution": True,
    "wg_distribution": True,
    "param_distribution": True,
    "mv_distribution": True,
    "ops": ["min", "max", "norm", "mean", "zeros", "nans"],
    "format": ["csv"],
    "start_step": 0,
    "step_interval": 1,
    "step_count_per_record": 50,
}


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


def train(steps: int, config_path: Optional[str], seed: int = 0, grad_acc_steps: int = 1, batch: int = 8,
          seq: int = 32, vocab: int = 256, hidden: int = 64, layers: int = 2, lr: float = 3e-3,
          log_every: int = 50) -> tuple[list[float], Optional[str]]:
    """Trains TinyGPT; with a config, under trainmon. Returns the losses and the output directory."""
    torch.manual_seed(seed)
    model = TinyGPT(vocab=vocab, hidden=hidden, layers=layers, seq=seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    monitor = None
    if config_path is not None:
        from trainmon import TrainerMon
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
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  ({time.time() - start:.1f}s)", flush=True)
    output = None
    if monitor is not None:
        monitor.stop()
        output = str(monitor.output_dir)
    return losses, output


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a trainmon JSON config (default: the embedded demo config)")
    parser.add_argument("--steps", type=positive_int, default=300)
    parser.add_argument("--grad-acc-steps", type=positive_int, default=1)


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="train a small GPT-style model with monitoring and show the output",
                                   description=__doc__)
    add_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    config_path = args.config
    if config_path is None:
        handle = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="trainmon_demo_", delete=False)
        with handle:
            json.dump(DEMO_CONFIG, handle)
        config_path = handle.name
    losses, output = train(args.steps, config_path, grad_acc_steps=args.grad_acc_steps)
    print(f"\ntrained {len(losses)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}"
          f"{'' if math.isfinite(losses[-1]) else ' (non-finite!)'}")
    print(f"monitor output: {output}")
    print(f"  files:        ls {output}")
    first = sorted(glob.glob(os.path.join(output, "grad_reduced_*.csv")))[:1]
    if first:
        print(f"  one family:   python -c \"import pandas; print(pandas.read_csv('{first[0]}'))\"")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="train_demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
