"""A torch optimizer on Megatron-Core model chunks (Megatron-Core's quick-start trains with torch.optim.Adam
and `get_forward_backward_func`).

Names, the pipeline stage and coordinates are the model's (`MegatronPlacement`), as under Megatron's
optimizer. Grads, weights and Adam state are read as the torch-side adapter (plain, or torch DDP) reads
them, except where the chunks are wrapped in Megatron's DistributedDataParallel: it accumulates grads in
`main_grad` and sets `.grad` to None, so grads come from `main_grad` and unreduced grads from its bucket
groups. Each rank records its own pieces (TP shards are not merged: the torch optimizer knows nothing of them).
"""
from __future__ import annotations

import torch

from trainmon.adapters.megatron_model import GradBufferCapture, MegatronPlacement, bucket_groups


class TorchOptimizerOnMegatron(MegatronPlacement):
    """Args: inner (the adapter the torch optimizer alone would get), chunks (the Megatron model chunks)."""

    def __init__(self, inner, chunks: list[torch.nn.Module]):
        super().__init__(chunks)
        self.inner = inner
        self.name = f"{inner.name} on a Megatron-Core model"
        self._buffers = GradBufferCapture(chunks, lambda p: p.main_grad) if bucket_groups(chunks) else None
        self._capture = self._buffers or inner
        self.unreduced_capture = self._capture.unreduced_capture

    def prepare(self, params):
        return self.inner.prepare(params)

    def install_unreduced(self, params, record) -> None:
        self._capture.install_unreduced(params, record)

    def remove(self) -> None:
        self._capture.remove()

    def step_owner(self):
        return self.inner.step_owner()

    def reduced_grads(self, params):
        if self._buffers is None:
            return self.inner.reduced_grads(params)
        return [getattr(w.param, "main_grad", None) for w in params]

    def inner_steps(self, params):
        return self.inner.inner_steps(params)

    def skipped_grads(self, params):
        return self.reduced_grads(params)

    def watch_skips(self, on_skip):
        return self.inner.watch_skips(on_skip)

    def clipping(self, step_result):
        return self.inner.clipping(step_result)

    def main_params(self, params):
        return self.inner.main_params(params)

    def adam_pieces(self, params):
        return self.inner.adam_pieces(params)
