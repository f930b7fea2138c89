"""Megatron's legacy checkpoint layout: `iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`, one file per
tensor- and pipeline-parallel rank, merged here into full parameters with global layer numbers.

- Tensor parallelism splits a parameter along the dimension its kind dictates (COLUMN_PARALLEL: dim 0,
  ROW_PARALLEL: dim 1, everything else is replicated and read from TP rank 0). With gated linear units
  (`args.swiglu`) each fc1 shard holds [gate; up], so gates and ups are joined separately.
- Pipeline stages (and virtual-pipeline chunks `model0`, `model1`, ...) number their layers from 0; the
  global number adds the layers of every earlier (chunk, stage) in Megatron's order.
Files are memory-mapped: a parameter's shards are read from disk when the parameter is asked for.
Expert-parallel layouts (`mp_rank_TT_PPP_EEE`) are not merged.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

import torch

from trainmon.ckpt import safe_load
from trainmon.read.errors import InputError

LATEST = "latest_checkpointed_iteration.txt"
SHARD_FILE = "model_optim_rng.pt"
COLUMN_PARALLEL = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
                   "linear_fc1.weight", "linear_fc1.bias", "linear_q_proj.weight", "linear_kv_up_proj.weight",
                   "linear_q_up_proj.weight", "query_key_value.weight", "query_key_value.bias",
                   "dense_h_to_4h.weight", "dense_h_to_4h.bias")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight", "dense.weight", "dense_4h_to_h.weight")
GATED = ("linear_fc1.weight", "linear_fc1.bias", "dense_h_to_4h.weight", "dense_h_to_4h.bias")
_RANK_DIR = re.compile(r"mp_rank_(\d+)(?:_(\d+))?(_\d+)?$")
_LAYER = re.compile(r"^((?:.*\.)?layers)\.(\d+)\.(.*)$")


def is_legacy(path: Path) -> bool:
    return path.is_dir() and ((path / LATEST).exists() or any(path.glob(f"mp_rank_*/{SHARD_FILE}"))
                              or any(path.glob(f"iter_*/mp_rank_*/{SHARD_FILE}")))


def iteration_dir(path: Path) -> Path:
    """The directory of shard directories: `path` itself, or the iteration `latest_checkpointed_iteration.txt`
    names (`release` or a number)."""
    if any(path.glob(f"mp_rank_*/{SHARD_FILE}")):
        return path
    latest = path / LATEST
    if not latest.exists():
        raise InputError.at(path, f"holds iter_* directories but no {LATEST}: give one iter_* directory")
    text = latest.read_text().strip()
    if text != "release" and not text.isdigit():
        raise InputError.at(latest, f"names no iteration ({text[:40]!r})")
    chosen = path / (text if text == "release" else f"iter_{int(text):07d}")
    if not chosen.is_dir():
        raise InputError.at(latest, f"names iteration {text}, but {chosen} does not exist")
    return chosen


class MegatronLegacy:
    kind = "megatron-legacy"

    def __init__(self, path: Path):
        self.path = iteration_dir(path)
        states: dict[tuple[int, int], Mapping] = {}
        for shard in sorted(self.path.glob(f"mp_rank_*/{SHARD_FILE}")):
            match = _RANK_DIR.match(shard.parent.name)
            if match is None or match.group(3):
                raise InputError.at(shard.parent, "not a tensor/pipeline rank directory (expert-parallel "
                                                  "layouts are not merged)")
            states[(int(match.group(1)), int(match.group(2) or 0))] = safe_load.load(shard)
        self.tp = 1 + max(t for t, _ in states)
        self.pp = 1 + max(p for _, p in states)
        missing = [(t, p) for t in range(self.tp) for p in range(self.pp) if (t, p) not in states]
        if missing:
            raise InputError.at(self.path, f"missing shards (tp, pp) {missing}")
        args = states[(0, 0)].get("args")
        self.gated = bool(getattr(args, "swiglu", False) or getattr(args, "gated_linear_unit", False))
        self._where = self._global_names(states)  # name -> [(tp rank's model dict, local key)]

    def _global_names(self, states) -> dict[str, list[tuple[Mapping, str]]]:
        chunks = sorted({k for sd in states.values() for k in sd if re.fullmatch(r"model\d*", k)},
                        key=lambda k: int(k[5:] or 0))
        if not chunks:
            raise InputError.at(self.path, "the shards hold no 'model' state dict")
        where: dict[str, list] = {}
        offset = 0
        for chunk in chunks:  # Megatron's layer order: chunk by chunk, stage by stage within a chunk
            for stage in range(self.pp):
                models = [states[(t, stage)].get(chunk, {}) for t in range(self.tp)]
                layers = set()
                for key, value in models[0].items():
                    if not isinstance(value, torch.Tensor):
                        continue  # _extra_state and other non-tensors
                    match = _LAYER.match(key)
                    name = key
                    if match:
                        layers.add(int(match.group(2)))
                        name = f"{match.group(1)}.{offset + int(match.group(2))}.{match.group(3)}"
                    where.setdefault(name, [(m, key) for m in models])  # shared weights: the first stage's
                offset += len(layers)
        return where

    def names(self) -> list[str]:
        return list(self._where)

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self._merge(name, [model[key] for model, key in self._where[name]])
        except (KeyError, RuntimeError) as err:  # a shard without the parameter, or of another shape
            raise InputError.at(self.path, f"the TP shards of {name!r} do not merge ({err})") from None

    def _merge(self, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        if self.tp == 1:
            return shards[0]
        if name.endswith(ROW_PARALLEL):
            return torch.cat(shards, dim=1)
        if name.endswith(COLUMN_PARALLEL):
            if self.gated and name.endswith(GATED):
                gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
                return torch.cat(gates + ups, dim=0)
            return torch.cat(shards, dim=0)
        return shards[0]
