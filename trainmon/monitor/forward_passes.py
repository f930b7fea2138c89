"""What a forward pass of the model is: a training micro-step or an evaluation forward.

A micro-step is one training forward/backward: a forward of the model (its first chunk) with grad
enabled and the model in training mode. Evaluation and validation forwards (`torch.no_grad()`,
`torch.inference_mode()`, `model.eval()`) take no micro-step number, so they do not shift the numbers of
the training forwards; they are counted as evaluation passes instead. The decision is taken once, when
the model's forward starts, because modules inside a training forward may legitimately run without grad
(reentrant activation checkpointing) or in eval mode (a frozen submodule).
"""
from __future__ import annotations

import torch

from trainmon.monitor.state import HookState


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (where only activation
    checkpointing runs module forwards)."""
    return torch._C._current_graph_task_id() != -1


class ForwardPasses:
    """Classifies and counts the forward passes of `root` in `state`."""

    def __init__(self, state: HookState, root: torch.nn.Module):
        self.state = state
        self.root = root
        self._handle = None

    def install(self) -> None:
        state = self.state

        def pre_hook(module, args):
            if in_backward():  # the whole model run again by activation checkpointing: same micro-step
                return
            state.training_forward = module.training and torch.is_grad_enabled()
            if state.training_forward:
                state.forward_micro += 1
            else:
                state.eval_pass += 1

        # First among the root's pre-hooks, so every other hook of this pass sees its micro-step.
        self._handle = self.root.register_forward_pre_hook(pre_hook, prepend=True)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
