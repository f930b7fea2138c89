"""A tiny deterministic training loop shared by the tests."""
from __future__ import annotations

import torch

from trainmon.demo import TinyGPT, lm_loss, synthetic_batch

VOCAB, SEQ, BATCH = 64, 16, 4
# the devices of the end-to-end tests: a GPU's case runs wherever torch sees one
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_model(seed: int = 0, layers: int = 2, hidden: int = 32, device: str = "cpu") -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab=VOCAB, hidden=hidden, layers=layers, heads=4, seq=SEQ).to(device)


def batches(seed: int = 1, device: str = "cpu"):
    """The same batches on every device: drawn on the CPU, then moved."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield tuple(t.to(device) for t in synthetic_batch(gen, BATCH, SEQ, VOCAB))


def run_steps(model, optimizer, steps: int, grad_acc_steps: int = 1, data=None, on_step=None):
    """Trains `steps` optimizer steps; returns the losses. `on_step(step)` runs before each step()."""
    data = data or batches(device=next(model.parameters()).device)
    losses = []
    for step in range(steps):
        total = 0.0
        for _ in range(grad_acc_steps):
            tokens, labels = next(data)
            loss = lm_loss(model, tokens, labels) / grad_acc_steps
            loss.backward()
            total += loss.item()
        if on_step is not None:
            on_step(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses
