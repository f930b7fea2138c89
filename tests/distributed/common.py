"""Shared by the multi-process jobs in this directory (run under torchrun, not imported by pytest)."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

VOCAB, SEQ, HIDDEN, LAYERS, MBS = 64, 16, 32, 2, 4


class TinyLM(nn.Module):
    def __init__(self, vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, seq=SEQ):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(hidden, 4, 2 * hidden, dropout=0.0, batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1),
                             persistent=False)
        self.saves = None  # a SavedLogits on the monitored model: its logits go to trainmon.save / save_grad

    def forward(self, x, y):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h, src_mask=self.mask)
        logits = self.head(h)
        if self.saves is not None:
            logits = self.saves(logits)
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def batches(seed: int):
    """Learnable synthetic data (next token = token + 1), different per data-parallel rank via `seed`."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, VOCAB, (MBS, 1), generator=gen)
        tokens = (start + torch.arange(SEQ + 1)) % VOCAB
        yield tokens[:, :-1], tokens[:, 1:]


def write_config(path: str, **keys) -> str:
    base = dict(wg_distribution=True, mv_distribution=True, param_distribution=True, squash_name=True,
                format="csv", ndigits=17, ops=["norm", "min", "max", "nans", "zeros", "mean"], strict=True)
    base.update(keys)
    with open(path, "w") as f:
        json.dump(base, f)
    return path


class SavedLogits:
    """Gives the logits to `trainmon.save` and `trainmon.save_grad`, and keeps the tensors and grads it gave
    (read by a test hook) for `Truth`, as families `save` and `save_grad` per micro-step."""

    def __init__(self):
        self.values, self.grads = [], []

    def __call__(self, logits):
        import trainmon

        trainmon.save("logits", logits)
        self.values.append(logits.detach().clone())
        logits.register_hook(lambda grad: self.grads.append(grad.detach().clone()))
        return trainmon.save_grad("logits", logits)

    def add_to(self, truth: "Truth", step: int, micro: int = 0) -> None:
        """After a micro-step's backward: its logits and their grad."""
        truth.add(step, "save", "logits", self.values.pop(), micro=micro)
        truth.add(step, "save_grad", "logits", self.grads.pop(), micro=micro)


class Truth:
    """Figures computed directly with torch on this rank: {step: {family: {name: norm}}}, written as JSON."""

    def __init__(self):
        self.data: dict = {}

    def add(self, step: int, family: str, name: str, tensor, micro: int = None) -> None:
        """With `micro`, the figure of that micro-step of the step, stored as `<name>@<micro>`."""
        if tensor is not None:
            key = name if micro is None else f"{name}@{micro}"
            self.data.setdefault(str(step), {}).setdefault(family, {})[key] = float(tensor.double().norm())

    def add_sign_agreement(self, step: int, name: str, grad, exp_avg) -> None:
        """mg_direction: 1 where sign(grad) = sign(exp_avg); its norm is √(agreeing elements)."""
        if grad is not None and exp_avg is not None:
            agree = torch.sign(grad.reshape(exp_avg.shape)) == torch.sign(exp_avg)
            self.add(step, "mg_direction", name, agree.float())

    def write(self, out_dir: str, rank: int) -> None:
        with open(os.path.join(out_dir, f"truth.rank{rank}.json"), "w") as f:
            json.dump(self.data, f)


class LocalGrads:
    """This rank's own grads of each step, from its data alone ({(step, name): tensor}, summed over the
    step's micro-batches), saved with torch so that a test can average them across ranks itself."""

    def __init__(self):
        self.grads: dict = {}

    def add(self, step: int, name: str, grad) -> None:
        earlier = self.grads.get((step, name))
        self.grads[(step, name)] = grad.detach().clone() if earlier is None else earlier + grad

    def write(self, out_dir: str, rank: int) -> None:
        torch.save(self.grads, os.path.join(out_dir, f"local_grads.rank{rank}.pt"))


def finish(monitor, out_dir: str = None, patched_objects=()) -> None:
    """Stops the monitor and ends the job without the interpreter-exit aborts gloo jobs sometimes hit.

    With `out_dir`, writes `restored.rank<R>.json`: whether `stop()` left none of `patched_objects`
    (framework objects whose methods trainmon wraps on the instance) with an instance attribute.
    """
    monitor.stop()
    if out_dir is not None:
        leftovers = sorted({f"{type(o).__name__}.{name}" for o in patched_objects
                            for name in ("step", "start_grad_sync", "routing") if name in vars(o)})
        with open(os.path.join(out_dir, f"restored.rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"objects": len(patched_objects), "leftovers": leftovers}, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def inject_inf(module: nn.Module, spec: str, rank: int, current_step) -> None:
    """Puts an inf into the first element of `module`'s output (the first tensor of a tuple output) on
    the rank and step of `spec` ("RANK:STEP[:MICRO]"), with MICRO only in the module's MICRO-th call of
    that step (its micro-batch); `current_step()` tells the running step.

    Register it before the monitor's hooks, so the output the monitor sees already carries the inf.
    """
    bad_rank, bad_step, *micro = (int(v) for v in spec.split(":"))
    calls = {}

    def hook(module, inputs, output):
        step = current_step()
        calls[step] = call = calls.get(step, -1) + 1
        if rank != bad_rank or step != bad_step or (micro and call != micro[0]):
            return None
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        hidden.view(-1)[0] = float("inf")
        return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden

    module.register_forward_hook(hook)


# cc_distribution of the jobs' `--cc` modes: "on" is `{"enable": true}` alone, as a user would turn it on.
CC_MODES = {"off": {"enable": False}, "on": {"enable": True}, "no-inputs": {"enable": True, "cc_pre_hook": False}}


def injection_config() -> dict:
    """What a fault-injection job records: the sentinel and AnomalyNan online, forward activations, csv and db
    (CSV needs the `infs` op to show an inf)."""
    return dict(sentinel=True, alert={"rules": [{"rule_name": "AnomalyNan"}]}, xy_distribution=True,
                forward_only=True, format=["csv", "db"], ops=["norm", "min", "max", "nans", "infs", "zeros", "mean"])
