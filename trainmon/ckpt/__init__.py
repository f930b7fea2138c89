"""`trainmon ckpt-compare`: per-parameter distances between two checkpoints of Megatron-Core, DeepSpeed,
torch.distributed.checkpoint, plain torch.save or safetensors, merged to full parameters."""
from trainmon.ckpt.compare import compare_checkpoints
from trainmon.ckpt.detect import open_checkpoint

__all__ = ["compare_checkpoints", "open_checkpoint"]
