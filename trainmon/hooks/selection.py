"""Which modules and parameters a config watches, and how their names are written."""
from __future__ import annotations

import torch

from trainmon.adapters.base import WatchedParam
from trainmon.adapters.naming import display_name
from trainmon.config.settings import MonitorConfig, parse_target_spec
from trainmon.hooks import in_graph
from trainmon.hooks.module_hooks import WatchedModule

# Wrapper components that `squash_name` removes from names (DDP, torch.compile, FSDP, checkpointing).
def _target_for(targets: dict, name: str, vpp: int):
    for candidate in (name, f"{vpp}:{name}"):
        if candidate in targets:
            return targets[candidate]
    return None


def _matches_prefix(targets: dict, name: str, vpp: int) -> bool:
    """`layers.1` matches `layers.1.weight` but not `layers.10.weight`."""
    for candidate in (name, f"{vpp}:{name}"):
        parts = candidate.split(".")
        if any(".".join(parts[:i]) in targets for i in range(1, len(parts) + 1)):
            return True
    return False


# torch's checkpoint wrappers (and its offload wrapper) hold the module they wrap under this name
_CHECKPOINTED = "_checkpoint_wrapped_module"


def module_places(chunk: torch.nn.Module, squash: bool) -> list[tuple[str, tuple[str, ...], torch.nn.Module]]:
    """(name written, the module names folded into it, the module hooked there) of each module of `chunk`.

    Where `squash` folds a wrapper's name into the module it wraps (DDP's and DeepSpeed's `module`, a checkpoint
    wrapper's `_checkpoint_wrapped_module`), the chain is one place, hooked once (hooking each would record
    every call twice under one name): at its innermost module, which every call through the chain reaches, and
    whose tensors are those of the model as written (a wrapper may move or cast what it passes on: Megatron's
    Float16Module, FSDP's mixed precision); but at a checkpoint wrapper rather than the module it wraps, which
    it calls with the same tensors, inside the checkpointed region (run a second time in backward, and where a
    compiled graph hands back no grads)."""
    places: dict[str, tuple[tuple[str, ...], torch.nn.Module]] = {}
    for name, module in in_graph.named_modules(chunk):  # an outer module before those it wraps
        place = display_name(name, squash)
        if place not in places:
            places[place] = ((name,), module)
            continue
        folded, hooked = places[place]
        places[place] = (folded + (name,), hooked if name.endswith(_CHECKPOINTED) else module)
    return [(place, names, module) for place, (names, module) in places.items()]


def watched_modules(chunks: list[torch.nn.Module], config: MonitorConfig) -> list[WatchedModule]:
    every = config.all_xy or not config.targets
    out = []
    for vpp, chunk in enumerate(chunks):
        for place, names, module in module_places(chunk, config.squash_name):
            target = next((t for t in (_target_for(config.targets, n, vpp) for n in names) if t is not None), None)
            if not every and target is None:
                continue
            target = target or {}
            out.append(WatchedModule(
                name=place, module=module, vpp_stage=vpp,
                input_sel=_selector(target, "input"), output_sel=_selector(target, "output"),
                input_grad_sel=_selector(target, "input_grad"), output_grad_sel=_selector(target, "output_grad")))
    return out


def _selector(target: dict, key: str):
    spec = target.get(key)
    return parse_target_spec(spec) if spec else None


def watched_params(chunks: list[torch.nn.Module], config: MonitorConfig) -> list[WatchedParam]:
    out = []
    for vpp, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if config.targets and not _matches_prefix(config.targets, name, vpp):
                continue
            out.append(WatchedParam(display_name(name, config.squash_name), param, vpp))
    return out
