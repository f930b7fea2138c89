"""Which hook groups a config installs, in one table, and how each is built from the monitor's set-up.

TrainerMon walks `GROUPS` in order: a group whose `wanted(setup)` holds is built and installed, and from then
on stepped and removed with the others (the `HookGroup` interface). Order matters where a group uses an
earlier one (the alert action reads the sentinel; saved variables go to the sentinel and the tensor dump;
the optimizer hooks close the grad hooks' step).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from trainmon.anomaly.actions import StepGate
from trainmon.core.layout import CC_LOG_FILE, STACK_INFO_FILE
from trainmon.hooks import in_graph
from trainmon.adapters import ADAPTER, ADAPTER_PER_MICRO_BATCH, NOT_RECORDED, PER_MICRO_BATCH
from trainmon.hooks.collectives import CollectiveMonitor
from trainmon.config.settings import MonitorConfig
from trainmon.hooks.feature_hooks import L2Features, feature_modules
from trainmon.hooks.forward_passes import ForwardPasses
from trainmon.hooks.grad_hooks import AdapterGradCapture, GradHooks
from trainmon.hooks.hook_group import HookGroup
from trainmon.hooks.loss_scale import LossScaleWatch
from trainmon.hooks.module_hooks import ActivationHooks
from trainmon.hooks.moe_load import MoeLoad
from trainmon.hooks.optimizer_hooks import OptimizerHooks
from trainmon.hooks.saved import SavedVariables
from trainmon.hooks.selection import watched_modules
from trainmon.hooks.sentinel import nan_sentinel
from trainmon.hooks.state import HookState
from trainmon.hooks.structure import StackRecorder
from trainmon.hooks.tensor_dump import TensorDump

logger = logging.getLogger("trainmon")


@dataclass
class SetUp:
    """What the groups are built from: one TrainerMon's model, optimizer, adapter, state and outputs."""

    config: MonitorConfig
    state: HookState
    chunks: list
    optimizer: object
    adapter: object
    params: list                      # the watched parameters, named as the adapter names them
    rank: int
    output_dir: Path
    writes: bool                      # this rank writes records (`module_ranks`)
    anomalies: Optional[object]       # the online anomaly processor, when the config has rules
    dump_sink: Optional[object]       # the `dump` block's sink
    drain: Callable[[], None]         # waits until the writer has written everything queued
    step_of: Callable[[], int]
    end_step: Callable[[], None]
    log_scalar: Callable
    built: dict = field(default_factory=dict)  # name -> group, in table order

    @cached_property
    def modules(self) -> list:
        """The watched modules (activations and their call stacks), named as the adapter names them."""
        modules = watched_modules(self.chunks, self.config)
        for watched in modules:
            watched.name = self.adapter.rename(watched.vpp_stage, watched.name)
        return modules



class Group(NamedTuple):
    name: str
    wanted: Callable[[SetUp], bool]
    build: Callable[[SetUp], Optional[HookGroup]]


def unreduced_mode(config: MonitorConfig, adapter) -> str:
    """How unreduced grads are captured: per micro-batch when `monitor_mbs_grad` asks, else as the adapter can."""
    capture = adapter.unreduced_capture
    # An adapter that captures every backward pass already gives what monitor_mbs_grad asks for.
    return PER_MICRO_BATCH if config.monitor_mbs_grad and capture != ADAPTER_PER_MICRO_BATCH else capture


def _sentinel(s: SetUp) -> HookGroup:
    sentinel = nan_sentinel(s.state, s.chunks, s.config.squash_name, s.adapter.rename)
    if s.config.alert.dump and s.anomalies is not None:
        sentinel.enable_dump(s.anomalies.add_dump, s.rank)
    return sentinel


def _alert_action(s: SetUp) -> HookGroup:
    sentinel = s.built.get("sentinel")
    return StepGate(s.config.alert.action, s.adapter.step_owner(), step_of=s.step_of, end_step=s.end_step,
                    evidence=lambda: [s.state.collector.any_nonfinite(), sentinel and sentinel.any_nonfinite()],
                    drain=s.drain, processor=s.anomalies)


def _unreduced_grads(s: SetUp) -> Optional[HookGroup]:
    mode = unreduced_mode(s.config, s.adapter)
    if mode in (ADAPTER, ADAPTER_PER_MICRO_BATCH):
        return AdapterGradCapture(s.state, s.adapter, s.params, per_micro_batch=mode == ADAPTER_PER_MICRO_BATCH)
    if mode == NOT_RECORDED:
        logger.warning("trainmon: grad_unreduced is not recorded with the %s adapter", s.adapter.name)
        return None
    return GradHooks(s.state, s.params, mode)


def _optimizer(s: SetUp) -> HookGroup:
    c = s.config
    grad_hooks = s.built.get("grad_unreduced")
    return OptimizerHooks(s.state, s.adapter, s.params, reduced_grads=c.wg_distribution,
                          params_before_after=c.param_distribution, moments=c.mv_distribution,
                          update_ratio=c.ur_distribution, sign_agreement=c.mg_direction, end_step=s.end_step,
                          before_update=[grad_hooks.at_update] if isinstance(grad_hooks, GradHooks) else [])


def _tensor_dump(s: SetUp) -> HookGroup:
    chosen = s.config.dump.modules
    modules = []
    for vpp, chunk in enumerate(s.chunks):
        for name, module in in_graph.named_modules(chunk):
            name = s.adapter.rename(vpp, name)
            if chosen == "all" or any(name == m or name.startswith(m + ".") for m in chosen):
                modules.append((name, module))
    return TensorDump(s.config.dump, modules, s.chunks, s.rank, s.step_of, s.dump_sink.add, s.state.guarded)


def _collectives(s: SetUp) -> Optional[HookGroup]:
    cc = s.config.cc_distribution
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        logger.warning("trainmon: cc_distribution is on but torch.distributed is not initialised: "
                       "no collectives to record")
        return None
    return CollectiveMonitor(s.state, cc.cc_pre_hook, cc.cc_codeline, cc.cc_log_only, s.output_dir / CC_LOG_FILE)


def _l2_features(s: SetUp) -> HookGroup:
    modules = feature_modules(s.chunks, s.config.l2_targets, s.config.squash_name, s.adapter.rename)
    return L2Features(s.state, modules, s.config.sa_order)


GROUPS: tuple[Group, ...] = (
    Group("sentinel", lambda s: s.config.sentinel, _sentinel),
    Group("alert_action", lambda s: s.config.alert.action != "warn" and s.anomalies is not None, _alert_action),
    # activations are never merged across ranks: a rank that writes nothing collects none
    Group("activations", lambda s: s.config.xy_distribution and s.writes,
          lambda s: ActivationHooks(s.state, s.modules, forward=not s.config.backward_only,
                                    backward=not s.config.forward_only)),
    # features are a rank's own, never merged: a rank that writes nothing computes none
    Group("l2_features", lambda s: s.config.recording_l2_features and s.writes, _l2_features),
    # merged over the expert-parallel group: every rank of it collects (TrainerMon's schedule), writing or not
    Group("moe_load", lambda s: s.config.moe_load,
          lambda s: MoeLoad(s.state, s.chunks, s.config.squash_name, s.adapter.rename)),
    Group("stacks", lambda s: s.config.xy_distribution and s.writes and s.config.stack_info,
          lambda s: StackRecorder(s.state, s.modules, s.output_dir / STACK_INFO_FILE)),
    Group("grad_unreduced", lambda s: s.config.wg_distribution, _unreduced_grads),
    Group("optimizer", lambda s: True, _optimizer),
    Group("forward_passes", lambda s: True, lambda s: ForwardPasses(s.state, s.chunks)),
    Group("loss_scale", lambda s: True, lambda s: LossScaleWatch(s.log_scalar, s.state.guarded, s.optimizer)),
    Group("tensor_dump", lambda s: s.config.dump is not None and s.dump_sink is not None, _tensor_dump),
    # trainmon.save / save_grad reach this monitor through the process's active hook group
    Group("saved", lambda s: s.writes,
          lambda s: SavedVariables(s.state, s.built.get("sentinel"), s.built.get("tensor_dump"))),
    Group("collectives", lambda s: s.config.cc_distribution.enable and s.writes, _collectives),
)


def build_groups(setup: SetUp) -> list[HookGroup]:
    """The groups `setup.config` asks for, built in table order (not yet installed)."""
    for group in GROUPS:
        if group.wanted(setup):
            built = group.build(setup)
            if built is not None:
                setup.built[group.name] = built
    return list(setup.built.values())


def config_warnings(config: MonitorConfig) -> list[str]:
    """What to say about keys that ask for something another key must turn on."""
    said = []
    if config.alert.dump and not config.sentinel:
        said.append("trainmon: alert.dump saves tensors found by the NaN sentinel; add \"sentinel\": true to the "
                    "config to get dumps")
    if config.alert.action != "warn" and not (config.sentinel or config.xy_distribution or config.wg_distribution):
        said.append(f"trainmon: alert.action {config.alert.action!r} acts on NaN/Inf seen before optimizer.step(), "
                    "but neither the sentinel nor activation/weight-grad statistics are on; add \"sentinel\": true")
    return said
