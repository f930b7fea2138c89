"""What a forward pass of the model is: a training micro-step or an evaluation forward.

A micro-step is one training forward/backward: a forward of a model chunk with grad enabled and the
chunk in training mode. Evaluation and validation forwards (`torch.no_grad()`, `torch.inference_mode()`,
`model.eval()`) take no micro-step number, so they do not shift the numbers of the training forwards;
they are counted as evaluation passes instead. The decision is taken once, when the chunk's forward
starts, because modules inside a training forward may legitimately run without grad (reentrant
activation checkpointing) or in eval mode (a frozen submodule). Each chunk counts its own forwards: an
interleaved pipeline schedule runs several micro-batches through one chunk before the next chunk sees
the first.
"""
from __future__ import annotations

import torch

from trainmon.hooks.hook_group import Hooks
from trainmon.hooks import in_graph
from trainmon.hooks.in_graph import in_backward
from trainmon.hooks.state import HookState


class ForwardPasses(Hooks):
    """Classifies and counts the forward passes of every model chunk in `state`."""

    collects = "forward passes"
    required = True

    def __init__(self, state: HookState, chunks: list[torch.nn.Module]):
        self.state = state
        self.chunks = chunks
        self._handles: list = []

    def install(self) -> None:
        for vpp, chunk in enumerate(self.chunks):
            # First among the chunk's pre-hooks, so every other hook of this pass sees its micro-step.
            self._handles.append(in_graph.forward_pre_hook(chunk, "forward_passes", self._pre_hook(vpp), prepend=True))

    def _pre_hook(self, vpp: int):
        state = self.state

        def pre_hook(module, args):
            if not in_backward():  # a whole chunk run again by activation checkpointing: same micro-step
                state.start_forward(vpp, module.training and torch.is_grad_enabled())

        return pre_hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
