"""DeepSpeed checkpoints (`<dir>/latest`, `global_step<N>/…_model_states.pt`, ZeRO `…_optim_states.pt`),
read with DeepSpeed's own zero-to-fp32 reader, which merges the ZeRO partitions into full fp32 parameters.

DeepSpeed's reader calls `torch.load(weights_only=False)`; while it runs, `torch.load` is replaced by
trainmon's safe loader, so nothing but tensors and the classes safe_load allows is unpickled. The reader
holds the whole state dict in memory (its format keeps every parameter in one flat partition per rank).
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from unittest import mock

import torch

from trainmon.ckpt import safe_load
from trainmon.ckpt.sources import flat_tensors
from trainmon.read.errors import InputError

MODEL_STATES = "*model_states.pt"


def is_deepspeed(path: Path) -> bool:
    return path.is_dir() and ((path / "latest").is_file() or any(path.glob(MODEL_STATES))
                              or any(path.glob(f"*/{MODEL_STATES}")))


def _tag_dir(path: Path) -> tuple[Path, str]:
    """(checkpoint directory, tag): `path` is the checkpoint directory (its `latest` names the tag) or a tag."""
    if any(path.glob(MODEL_STATES)):
        return path.parent, path.name
    latest = path / "latest"
    if not latest.is_file():
        raise InputError.at(path, "a DeepSpeed checkpoint directory without a 'latest' file: give a global_step* "
                                  "directory")
    tag = latest.read_text().strip()
    if not (path / tag).is_dir():
        raise InputError.at(latest, f"names tag {tag!r}, but {path / tag} does not exist")
    return path, tag


def _safe_torch_load(f, *args, **kwargs):
    return safe_load.load(Path(f))


class DeepSpeedCheckpoint:
    kind = "deepspeed"

    def __init__(self, path: Path):
        root, tag = _tag_dir(path)
        self.path = root / tag
        if any(self.path.glob("*optim_states.pt")):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            try:
                # DeepSpeed reports its progress on stdout, which is the command's result
                with mock.patch.object(torch, "load", _safe_torch_load), contextlib.redirect_stdout(sys.stderr):
                    state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
            except InputError:
                raise
            except Exception as err:  # DeepSpeed's reader fails in its own ways on a damaged checkpoint
                raise InputError.at(self.path, f"DeepSpeed cannot read this checkpoint ({type(err).__name__}: "
                                               f"{err})") from None
        else:  # no ZeRO partitions (ZeRO-0): the model state file holds the whole module
            model_file = sorted(self.path.glob(MODEL_STATES))[0]
            loaded = safe_load.load(model_file)
            if not isinstance(loaded, dict) or "module" not in loaded:
                raise InputError.at(model_file, "holds no 'module' state dict")
            state = loaded["module"]
        self._tensors = dict(flat_tensors(state))

    def names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]
