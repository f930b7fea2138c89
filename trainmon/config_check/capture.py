"""Capturing a pack: what can be had without the model at once, and in a job the weights at set-up, the
random generators and the first input batches of every micro-step (from the root module's forward inputs)."""
from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

from trainmon.config_check import hyperparams
from trainmon.config_check.environment import filtered_environment, package_versions
from trainmon.config_check.pack import rank_file, write_pack
from trainmon.config_check.tensors import digests, flat_tensors, random_states

logger = logging.getLogger("trainmon")
DEFAULT_OUTPUT = "config_check"


def hyperparameter_member(args: Any = None, scripts: Iterable = (), yamls: Iterable = ()) -> dict:
    """{"compared": ..., "ignored": ..., "sources": ...}: args first, then scripts, then YAML files (the first
    source that names a setting wins)."""
    parsed = [("args", hyperparams.from_args(args))] if args is not None else []
    parsed += [(str(path), hyperparams.from_script(path)) for path in scripts]
    parsed += [(str(path), hyperparams.from_yaml(path)) for path in yamls]
    values: dict[str, Any] = {}
    for _, found in parsed:
        for name, value in found.items():
            values.setdefault(name, value)
    compared, ignored = hyperparams.split_ignored(values)
    return {"compared": compared, "ignored": ignored, "sources": [source for source, _ in parsed]}


def static_members(args: Any = None, scripts: Iterable = (), yamls: Iterable = ()) -> dict[str, Any]:
    """What a pack holds without the job's process state: environment, packages, hyperparameters."""
    return {"environment": filtered_environment(), "packages": package_versions(),
            "hyperparameters": hyperparameter_member(args, scripts, yamls)}


def _process_rank() -> tuple[Optional[int], int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None, 1


class ConfigCapture:
    """One rank's capture; the pack is written once `batches` training micro-steps were seen (or at `close()`).

    A micro-step is a forward of a root module with grad enabled and the module in training mode (design §2b).
    """

    def __init__(self, members: dict, path: Path, rank: Optional[int], world_size: int,
                 chunks: Sequence[torch.nn.Module] = (), batches: int = 1):
        self.members = members
        self.path = path
        self.rank, self.world_size = rank, world_size
        self.batches = batches
        self.written = False
        self._seen = [0] * len(chunks)
        self._handles = [chunk.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i, chunk in enumerate(chunks)] if batches else []
        if self._handles:
            atexit.register(self.close)  # a job that ends before `batches` micro-steps still gets its pack
        else:
            self.close()

    def _hook(self, index: int):
        prefix = f"{index}:" if len(self._seen) > 1 else ""

        def record(module, args, kwargs):
            micro_step = self._seen[index]
            if micro_step >= self.batches or not (module.training and torch.is_grad_enabled()):
                return
            self._seen[index] += 1
            named = list(flat_tensors(args, f"{prefix}input")) + list(flat_tensors(kwargs, f"{prefix}kwargs"))
            for row in digests(named):
                self.members["dataset"].append({"micro_step": micro_step, **row})
            if min(self._seen) >= self.batches:
                self.close()
        return record

    def close(self) -> Path:
        """Removes the hook and writes the pack (once); returns its path."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        atexit.unregister(self.close)
        if not self.written:
            write_pack(self.path, self.rank, self.world_size, self.members)
            self.written = True
            logger.info("trainmon: config-check pack written to %s", self.path)
        return self.path


def capture(model=None, args: Any = None, scripts: Iterable = (), yamls: Iterable = (),
            output: str | os.PathLike = DEFAULT_OUTPUT, batches: int = 1) -> ConfigCapture:
    """Records this process's configuration into a pack for `trainmon config-check compare`.

    Args:
        model: the model (or a list of virtual-pipeline chunks); with it, every weight's hash and statistics
            now, and the inputs of its first `batches` training micro-steps.
        args: argparse Namespace, Megatron `args` or a mapping of hyperparameters.
        scripts: shell launch scripts to parse for hyperparameters (`--lr 1e-4`, `LR=1e-4`).
        yamls: YAML configs to parse for hyperparameters.
        output: a directory (each rank writes `rank_<R>.zip` there) or, in a single process, a `.zip` file
            (in a distributed job `pack.zip` stands for the directory `pack/`).
        batches: training micro-steps whose inputs are recorded (0: none).

    Returns:
        The capture; its pack is written once the batches are in, or at `close()`.
    """
    rank, world_size = _process_rank()
    output = Path(output)
    if output.suffix == ".zip" and rank is None:
        path = output
    else:
        path = rank_file(output.with_suffix("") if output.suffix == ".zip" else output, rank or 0)
    members = {**static_members(args, scripts, yamls), "random": random_states()}
    chunks: list = []
    if model is not None:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        prefix = len(chunks) > 1
        members["weights"] = [row for i, chunk in enumerate(chunks)
                              for row in digests((f"{i}:{n}" if prefix else n, p)
                                                 for n, p in chunk.named_parameters())]
        members["dataset"] = []
    return ConfigCapture(members, path, rank, world_size, chunks, batches if model is not None else 0)
