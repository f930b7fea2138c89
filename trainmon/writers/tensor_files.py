"""Tensor files the writer thread writes: safetensors plus a JSON description (`alert.dump`'s
`<rank_dir>/anomaly_dumps/`, the `dump` block's `dumps/step<S>/`)."""
from __future__ import annotations

import json
from pathlib import Path

from trainmon.core.layout import ANOMALY_DUMPS_DIR
from trainmon.hooks.dump_capture import DumpRequest


def save_tensors(path: Path, tensors: dict) -> None:
    """Writes host tensors to one safetensors file."""
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path))


def write_dump(rank_dir: Path, request: DumpRequest) -> Path:
    """Writes `<rank_dir>/anomaly_dumps/step<S>_micro<M>_<module>.safetensors` and its `.json`."""
    directory = rank_dir / ANOMALY_DUMPS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"step{request.step}_micro{request.micro_step}_{request.module or 'root'}"
    save_tensors(directory / f"{stem}.safetensors", request.tensors)
    description = {"rank": request.rank, "step": request.step, "micro_step": request.micro_step,
                   "module": request.module, "phase": request.phase, "tensors": request.described,
                   "file": f"{stem}.safetensors"}
    (directory / f"{stem}.json").write_text(json.dumps(description, indent=1))
    return directory / f"{stem}.json"
