"""`print_struct` (the module tree) and `stack_info` (call stacks of the first collected step)."""
from __future__ import annotations

import traceback
from pathlib import Path

import torch

from trainmon.hooks.hook_group import Hooks
from trainmon.hooks import in_graph
from trainmon.config.output import write_json


def module_structure(chunks: list[torch.nn.Module]) -> dict:
    """{`<vpp>:<module name>`: {class, parameters: {name: shape}}} for every module."""
    tree = {}
    for vpp, chunk in enumerate(chunks):
        for name, module in in_graph.named_modules(chunk):
            tree[f"{vpp}:{name}"] = {
                "class": type(module).__name__,
                "parameters": {p_name: list(p.shape) for p_name, p in module.named_parameters(recurse=False)},
            }
    return tree


class StackRecorder(Hooks):
    """Records where each watched module is called from, during the first collected step only."""

    collects = "call stacks (stack_info)"

    def __init__(self, state, modules, path: Path):
        self.state = state
        self.modules = modules
        self.path = path
        self.stacks: dict[str, list[str]] = {}
        self._handles: list = []
        self._done = False

    def install(self) -> None:
        for watched in self.modules:
            self._handles.append(in_graph.forward_pre_hook(watched.module, "structure", self._make_hook(watched)))

    def _make_hook(self, watched):
        key = f"{watched.vpp_stage}:{watched.name}"

        def pre_hook(module, args):
            if self._done or not self.state.collecting or key in self.stacks:
                return
            self.stacks[key] = traceback.format_stack()[:-1]

        return pre_hook

    def step_finished(self, collected: bool) -> None:
        if collected and not self._done and self.stacks:
            self._done = True
            write_json(self.path, self.stacks)
            self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
