"""Which reader a checkpoint path needs."""
from __future__ import annotations

from pathlib import Path

from trainmon.ckpt.dcp import METADATA, DistCheckpoint
from trainmon.ckpt.deepspeed import DeepSpeedCheckpoint, is_deepspeed
from trainmon.ckpt.megatron import MegatronLegacy, is_legacy
from trainmon.ckpt.sources import SafetensorsFiles, Source, TorchFile
from trainmon.read.errors import InputError


def open_checkpoint(path: str | Path) -> Source:
    """A Source for a Megatron legacy or torch.distributed.checkpoint directory, a DeepSpeed checkpoint,
    a safetensors file or directory, or a torch.save file."""
    path = Path(path)
    if not path.exists():
        raise InputError.at(path, "no such file or directory")
    if path.is_dir():
        if (path / METADATA).is_file():
            return DistCheckpoint(path)
        if is_legacy(path):
            return MegatronLegacy(path)
        if is_deepspeed(path):
            return DeepSpeedCheckpoint(path)
        if any(path.glob("*.safetensors")):
            return SafetensorsFiles(path)
        raise InputError.at(path, "not a checkpoint directory (no Megatron mp_rank_*/iter_*, no "
                                  "torch.distributed.checkpoint .metadata, no DeepSpeed latest/*model_states.pt, "
                                  "no *.safetensors)")
    if path.suffix == ".safetensors":
        return SafetensorsFiles(path)
    with open(path, "rb") as f:
        head = f.read(8)
    if not head.startswith((b"PK", b"\x80")):  # torch.save: a zip (maybe cut short), or a legacy pickle stream
        raise InputError.at(path, "not a checkpoint file (neither a torch.save file nor safetensors)")
    return TorchFile(path)
