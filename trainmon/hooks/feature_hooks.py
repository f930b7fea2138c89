"""The hooks of msprobe's L2 features (`recording_l2_features`, `l2_targets`, `sa_order`).

Each hook of `l2_targets` is one row of `L2_HOOKS`: the family it writes, its features, which modules it takes
and how their values come from a call. A module's features are computed on its device in its forward hook
(trainmon.hooks.features) and recorded as one-element records, `<module>.<feature>` in the hook's family, so
they ride the step's single transfer to every sink like any record. As in msprobe, a feature is recorded at
training forwards only (not in evaluation, nor when activation checkpointing runs a forward again in backward);
attention and router-logit features at every training forward (per micro-step), weight features once per step,
from the weight the step's forwards use. Modules are named as activations are (`squash_name`, the adapter's
names); an `l2_targets` entry matches the module's own name or its written one, with or without `<vpp>:`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from trainmon.core.records import (ATTENTION_HOOK, LINEAR_HOOK, MOE_ROUTER_LOGIT_HOOK, MOE_ROUTER_WEIGHT_HOOK,
                                   PER_MICRO_FEATURE_FAMILIES, record_key)
from trainmon.hooks import features, in_graph
from trainmon.hooks.in_graph import in_backward
from trainmon.hooks.hook_group import Hooks
from trainmon.hooks.selection import module_places
from trainmon.hooks.state import HookState

logger = logging.getLogger("trainmon")

Values = Callable[["FeatureModule", tuple, dict, object, str], Optional[torch.Tensor]]


def linear_weight(module: torch.nn.Module) -> Optional[torch.Tensor]:
    """The 2-D weight msprobe's linear and router-weight hooks read (`weight`, else `wg`); None for embeddings."""
    if isinstance(module, torch.nn.Embedding) or hasattr(module, "num_embeddings") or \
            hasattr(module, "vocab_start_index"):
        return None
    for name in ("weight", "wg"):
        weight = getattr(module, name, None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return weight
    return None


@dataclass
class FeatureModule:
    """One hooked module: its written name, chunk, hook row, and what its hook keeps between calls."""

    name: str
    vpp_stage: int
    module: torch.nn.Module
    hook: "L2Hook"
    start: Optional[torch.Tensor] = None  # stable_rank's start vector, made at the first call
    last: tuple = (-1, -1, 0)  # (step, micro-step, calls there) of the last call recorded


def _attention(target: FeatureModule, args: tuple, kwargs: dict, output, order: str) -> Optional[torch.Tensor]:
    q = args[0] if len(args) > 0 else kwargs.get("query")
    k = args[1] if len(args) > 1 else kwargs.get("key")
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 4 and k.dim() >= 4):
        return None
    return features.attention_features(q, k, order)


def _linear(target: FeatureModule, args: tuple, kwargs: dict, output, order: str) -> Optional[torch.Tensor]:
    weight = linear_weight(target.module)
    if weight is None:
        return None
    if target.start is None or target.start.shape[0] != weight.shape[1]:
        start = features.power_iteration_start(weight.shape[1], torch.device("cpu"))
        target.start = start if weight.device.type == "cpu" else start.pin_memory().to(weight.device, non_blocking=True)
    return features.stable_rank(weight, target.start)


def _router_weight(target: FeatureModule, args: tuple, kwargs: dict, output, order: str) -> Optional[torch.Tensor]:
    weight = linear_weight(target.module)
    return None if weight is None else features.router_weight_similarity(weight)


def _router_logits(target: FeatureModule, args: tuple, kwargs: dict, output, order: str) -> Optional[torch.Tensor]:
    if isinstance(output, (list, tuple)):
        output = next((t for t in output if isinstance(t, torch.Tensor)), None)
    if not isinstance(output, torch.Tensor) or output.dim() < 2:
        return None
    return features.per_token_expert_entropy(output)


@dataclass(frozen=True)
class L2Hook:
    """One hook of `l2_targets`.

    Args:
        family: the family its records go to (msprobe's CSV prefix).
        features: the names of the values `values` returns, in order.
        values: (module, forward args, kwargs, output, sa_order) -> fp32 values on the device, or None when the
            call does not hold what the hook reads (said once per module).
        takes: which modules it can hook at all.
        every_module_when_empty: an empty module list in `l2_targets` takes every module `takes` allows.
        expects: what a module must give, for the message when it does not.
    """

    family: str
    features: tuple[str, ...]
    values: Values
    takes: Callable[[torch.nn.Module], bool]
    every_module_when_empty: bool
    expects: str

    @property
    def per_micro_step(self) -> bool:
        return self.family in PER_MICRO_FEATURE_FAMILIES


L2_HOOKS: dict[str, L2Hook] = {
    "attention_hook": L2Hook(ATTENTION_HOOK, features.ATTENTION_FEATURES, _attention, lambda m: True, False,
                             "q and k as its first two inputs, 4-D in the layout of sa_order"),
    "linear_hook": L2Hook(LINEAR_HOOK, features.LINEAR_FEATURES, _linear, lambda m: linear_weight(m) is not None,
                          True, "a 2-D weight"),
    "moe_router_weight_hook": L2Hook(MOE_ROUTER_WEIGHT_HOOK, features.ROUTER_WEIGHT_FEATURES, _router_weight,
                                     lambda m: linear_weight(m) is not None, False, "a 2-D router weight"),
    "moe_router_logit_hook": L2Hook(MOE_ROUTER_LOGIT_HOOK, features.ROUTER_LOGIT_FEATURES, _router_logits,
                                    lambda m: True, False, "router logits (at least 2-D) as its output"),
}


def feature_modules(chunks: list, l2_targets: dict[str, list[str]], squash: bool,
                    rename: Callable[[int, str], str]) -> list[tuple[str, str, int, torch.nn.Module]]:
    """(hook name, written name, vpp stage, module) of each module `l2_targets` chooses; an entry that names no
    module it can take is said once (a misspelled name records nothing)."""
    out, matched = [], set()
    for vpp, chunk in enumerate(chunks):
        for place, names, module in module_places(chunk, squash):
            written = rename(vpp, place)
            known = {written, place, *names}
            known |= {f"{vpp}:{n}" for n in known}
            for hook_name, entries in l2_targets.items():
                hook = L2_HOOKS[hook_name]
                hit = known.intersection(entries)
                if hook.takes(module) and (hit or (hook.every_module_when_empty and not entries)):
                    out.append((hook_name, written, vpp, module))
                    matched |= {(hook_name, entry) for entry in hit}
    missed = [f"{hook}: {entry}" for hook, entries in l2_targets.items() for entry in entries
              if (hook, entry) not in matched]
    if missed:
        logger.warning("trainmon: l2_targets names modules the model does not have, or that do not have what the hook "
                       "reads (a linear or router-weight hook needs a 2-D weight); not recorded: %s", "; ".join(missed))
    return out


class L2Features(Hooks):
    """Forward hooks computing msprobe's L2 features of the modules `l2_targets` names.

    Args:
        state: the shared hook state (collector, step gating, micro-steps).
        modules: (hook name of L2_HOOKS, written name, vpp stage, module) of each module to hook.
        sa_order: the layout of the attention modules' q and k.
    """

    collects = "L2 features (recording_l2_features)"

    def __init__(self, state: HookState, modules: list[tuple[str, str, int, torch.nn.Module]], sa_order: str):
        self.state = state
        self.sa_order = sa_order
        self.targets = [FeatureModule(name, vpp, module, L2_HOOKS[hook]) for hook, name, vpp, module in modules]
        self._handles: list = []
        self._skipped: set[tuple[str, str]] = set()

    def install(self) -> None:
        for target in self.targets:
            hook = self.state.guarded(f"{target.hook.family} of {target.name}", self._hook(target))
            # In the wrapper around the module's forward that the activation hooks may already have put there (one
            # op a call under torch.compile for all of them, whose graph runs the hook on the call's tensors).
            self._handles.append(in_graph.after_forward(target.module, target.hook.family, hook, self._recording))
        logger.info("trainmon: L2 features of %d module(s): %s", len(self.targets),
                    ", ".join(sorted({t.hook.family for t in self.targets})) or "none")

    def _recording(self) -> bool:
        """Whether the running forward pass is recorded (a collected step's training forward)."""
        return self.state.collecting and self.state.training_forward

    def _hook(self, target: FeatureModule):
        def hook(module, args, kwargs, output):
            if not self._recording() or in_backward():
                return None
            self._record(target, args, kwargs, output)
            return None
        return hook

    def _record(self, target: FeatureModule, args: tuple, kwargs: dict, output) -> None:
        collector = self.state.collector
        step, micro = collector.step, self.state.forward_micro(target.vpp_stage)
        last_step, last_micro, calls = target.last
        if not target.hook.per_micro_step:
            if last_step == step:
                return  # once a step: the weight is the same in every forward of the step
            place, name = (step, -1), target.name
        else:
            calls = calls + 1 if (last_step, last_micro) == (step, micro) else 0
            place, name = (step, micro), (target.name if not calls else f"{target.name}#{calls}")
        values = target.hook.values(target, args, kwargs, output, self.sa_order)
        if values is None:
            self._skip(target)
            return
        target.last = (*place, calls)
        index = collector.next_call_index()
        micro_step = micro if target.hook.per_micro_step else None
        keys = [record_key(target.hook.family, f"{name}.{feature}", target.vpp_stage, micro_step, index, (),
                           values.dtype) for feature in target.hook.features]
        collector.record(keys, list(values.unbind()))

    def _skip(self, target: FeatureModule) -> None:
        if (target.hook.family, target.name) not in self._skipped:
            self._skipped.add((target.hook.family, target.name))
            logger.warning("trainmon: %s is not recorded for %s: the module does not give %s", target.hook.family,
                           target.name or "<root>", target.hook.expects)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
