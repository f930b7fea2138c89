"""Mixture-of-experts load per layer (`moe_load`), from each router's own routing decision.

A router's tap sees, at every training forward, the router's logits and the tokens it sent to each expert after any
capacity drop: Megatron-Core's `TopKRouter` through its `routing` (the routing map it returns), DeepSpeed's
`TopKGate` after its forward (its dispatch mask, and the counts before the drop it returns beside it; inside a
torch.compile'd region too, where Megatron's `routing` is traced and counts nothing: such a router's load is not
recorded, and one message says so). It adds, on the device, into the step's sums: tokens per expert, routed tokens
(tokens × top-k before any drop), the sum of the tokens' router entropies and the tokens. At the step's end the sums
of every router are added over its expert-parallel group in one collective (each EP rank routes its own tokens to
every expert of the layer), and each layer's figures are recorded as one-element records
(`trainmon.core.records.MOE_LOAD`, `MOE_EXPERT_LOAD`):

- `<router>.imbalance`: the largest expert load over the mean load (1: balanced; 0 when no token was routed);
- `<router>.idle_experts`: experts that received no token;
- `<router>.dropped_tokens`: routes dropped by capacity (routed − received);
- `<router>.router_entropy`: the mean over tokens of the entropy of the softmax of their router logits;
- `<router>.expert_<e>`: the tokens expert `e` (global number) received.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from trainmon.core import feature_table
from trainmon.core.records import MOE_EXPERT_LOAD, MOE_LOAD, record_key
from trainmon.engine.accelerator import collective_device
from trainmon.hooks import in_graph
from trainmon.hooks.collectives import not_monitored
from trainmon.hooks.in_graph import in_backward
from trainmon.hooks.hook_group import Hooks
from trainmon.adapters.patching import patch_attribute
from trainmon.hooks.selection import module_places
from trainmon.hooks.state import HookState

logger = logging.getLogger("trainmon")

LAYER_FIGURES = feature_table.names(MOE_LOAD)
# The step's sums of one router after its experts' token counts: routed tokens, entropy sum, tokens.
ROUTED, ENTROPY_SUM, TOKENS = range(3)


def _entropy_sum(logits: torch.Tensor) -> torch.Tensor:
    """The sum over tokens of the entropy of each token's softmax over the experts (the last dimension)."""
    flat = logits.detach().float().reshape(-1, logits.shape[-1])
    p = torch.softmax(flat, dim=-1)
    return -torch.nansum(p * torch.log(p))


class RouterTap:
    """The step's sums of one router, on its device: [tokens per expert..., routed, entropy sum, tokens].

    Args:
        name: the router's written name.
        experts: the layer's experts (global).
        ep_group: the expert-parallel group its sums are added over (None: this rank's alone).
        device: where the router computes.
    """

    def __init__(self, name: str, experts: int, ep_group, device: torch.device):
        self.name = name
        self.experts = experts
        self.ep_group = ep_group
        self.sums = torch.zeros(experts + 3, dtype=torch.float64, device=device)
        self.forwards = 0  # the forwards added this step (counted on the host)

    def add(self, received: torch.Tensor, routed, logits: torch.Tensor) -> None:
        """One forward's routing: tokens per expert after the drop, routes before it (a number, or a tensor on the
        router's device), the router's logits."""
        self.forwards += 1
        sums = self.sums
        sums[: self.experts] += received.detach().to(torch.float64)
        tail = sums[self.experts:]
        tail[ROUTED] += routed
        tail[ENTROPY_SUM] += _entropy_sum(logits).to(torch.float64)
        tail[TOKENS] += logits.numel() // logits.shape[-1]

    def figures(self, sums: torch.Tensor) -> torch.Tensor:
        """The layer figures (LAYER_FIGURES) from merged sums, on the device."""
        load = sums[: self.experts]
        routed, entropy_sum, tokens = sums[self.experts:].unbind()
        received = load.sum()
        mean = received / self.experts
        zero = torch.zeros((), dtype=sums.dtype, device=sums.device)
        values = [torch.where(mean > 0, load.max() / mean.clamp_min(1e-300), zero), (load == 0).sum().to(sums.dtype),
                  routed - received, torch.where(tokens > 0, entropy_sum / tokens.clamp_min(1), zero)]
        return torch.stack(values)


class MoeLoad(Hooks):
    """Taps every router of the model and records each layer's load at the end of a collected step.

    Args:
        state: the shared hook state.
        chunks: the model chunks.
        squash: `squash_name`.
        rename: the adapter's names (global layer numbers).
    """

    collects = "MoE load (moe_load)"

    def __init__(self, state: HookState, chunks: list, squash: bool, rename):
        self.state = state
        self.chunks = chunks
        self.squash = squash
        self.rename = rename
        self.taps: list[RouterTap] = []
        self._undo: list = []
        self._untapped: set[str] = set()  # routers said to have run no counted forward

    def install(self) -> None:
        for vpp, chunk in enumerate(self.chunks):
            parents = {id(getattr(m, "router", None)): m for _, m in chunk.named_modules()}
            for place, _, module in module_places(chunk, self.squash):
                kind = type(module).__name__
                if kind == "TopKRouter" and hasattr(module, "routing"):
                    self._tap_megatron(self.rename(vpp, place), module, parents.get(id(module)))
                elif kind == "TopKGate" and hasattr(module, "wg"):
                    self._tap_deepspeed(self.rename(vpp, place), module)
        if not self.taps:
            logger.warning("trainmon: moe_load is on but the model has no router trainmon knows (Megatron-Core's "
                           "TopKRouter, DeepSpeed's TopKGate): no MoE load is recorded")
        else:
            logger.info("trainmon: MoE load of %d router(s)", len(self.taps))

    def _collecting(self) -> bool:
        """Whether this forward's routing is counted: a collected step's training forward (not activation
        checkpointing's second forward). Megatron's `routing`, traced inside a compiled region, counts nothing there;
        DeepSpeed's gate hook runs from the compiled graph as it would eagerly (`in_graph`)."""
        state = self.state
        # Compiling first: under tracing nothing of the state is read (Dynamo would guard on it, and compile again
        # each time collecting turns on or off).
        return not torch.compiler.is_compiling() and state.collecting and state.training_forward and \
            not in_backward()

    def _tap_megatron(self, name: str, router, layer) -> None:
        config = router.config
        # Padded to capacity, the routing map holds every expert's capacity slots, the padding among them; the
        # tokens an expert received are then the slots with a probability (padding has none).
        pads = config.moe_expert_capacity_factor is not None and config.moe_pad_expert_input_to_capacity
        tap = RouterTap(name, config.num_moe_experts, getattr(layer, "ep_group", None), router.weight.device)
        original = router.routing

        def routing(logits, *args, **kwargs):
            probs, routing_map = original(logits, *args, **kwargs)
            if self._collecting():
                record(logits, probs, routing_map)
            return probs, routing_map

        def add(logits, probs, routing_map):
            received = routing_map & (probs.detach() != 0) if pads else routing_map
            tap.add(received.sum(dim=0), routing_map.shape[0] * router.topk, logits)

        record = self.state.guarded(f"moe_load of {name}", add)
        self.taps.append(tap)
        self._undo.append(patch_attribute(router, "routing", routing))

    def _tap_deepspeed(self, name: str, gate) -> None:
        weight = gate.wg.weight
        tap = RouterTap(name, weight.shape[0], getattr(gate, "ep_group", None), weight.device)

        def hook(module, args, kwargs, output):
            if self._collecting():
                record(args[0] if args else kwargs["input"], output)

        def add(inputs, output):
            received = _deepspeed_received(output, tap.experts)
            if received is None:
                raise ValueError(f"TopKGate returned {len(output)} values, not the dispatch mask or routes trainmon "
                                 "reads")
            logits = torch.nn.functional.linear(inputs.detach().float(), weight.detach().float())
            tap.add(received, output[-1].sum(), logits)  # exp_counts: the routes before the capacity drop

        record = self.state.guarded(f"moe_load of {name}", add)
        self.taps.append(tap)
        # In the wrapper around the gate's forward: inside a torch.compile'd region the graph runs it too.
        self._undo.append(in_graph.after_forward(gate, "moe_load", hook, self._collecting).remove)

    def step_finished(self, collected: bool) -> None:
        if not collected or not self.taps:
            return
        for group, taps in _by_group(self.taps).items():
            merged = torch.cat([tap.sums for tap in taps])
            if group is not None and dist.get_world_size(group) > 1:
                merged = _all_reduce(merged, group)
            offset = 0
            for tap in taps:
                if tap.forwards:
                    self._record(tap, merged[offset:offset + tap.sums.numel()])
                else:  # its zeros would read as every expert idle
                    self._say_untapped(tap)
                offset += tap.sums.numel()
        for tap in self.taps:
            tap.sums.zero_()
            tap.forwards = 0

    def _say_untapped(self, tap: RouterTap) -> None:
        if tap.name not in self._untapped:
            self._untapped.add(tap.name)
            logger.warning("trainmon: the router %s ran no counted training forward in step %s (Megatron's routing "
                           "inside a torch.compile'd region is not counted): its MoE load is not recorded", tap.name,
                           self.state.collector.step)

    def _record(self, tap: RouterTap, sums: torch.Tensor) -> None:
        collector = self.state.collector
        index = collector.next_call_index()
        values = tap.figures(sums)
        keys = [record_key(MOE_LOAD, f"{tap.name}.{figure}", 0, None, index, (), values.dtype)
                for figure in LAYER_FIGURES]
        keys += [record_key(MOE_EXPERT_LOAD, f"{tap.name}.expert_{e}", 0, None, index, (), values.dtype)
                 for e in range(tap.experts)]
        collector.record(keys, list(torch.cat([values, sums[: tap.experts]]).unbind()))

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []


def _deepspeed_received(output, experts: int) -> Optional[torch.Tensor]:
    """Tokens per expert after the capacity drop from TopKGate's output: its dispatch mask [tokens, experts,
    capacity], or, with sparse routes, its expert indices (-1: dropped)."""
    if len(output) == 4:
        return output[2].sum(dim=(0, 2))
    if len(output) == 7:
        indices = output[3].reshape(-1).long()
        kept = indices >= 0
        return torch.zeros(experts, device=indices.device).index_add_(0, indices.clamp_min(0), kept.float())
    return None


def _by_group(taps: list[RouterTap]) -> dict:
    out: dict = {}
    for tap in taps:
        out.setdefault(tap.ep_group, []).append(tap)
    return out


def _all_reduce(sums: torch.Tensor, group) -> torch.Tensor:
    """`sums` added over `group`, on the device its backend needs, back on `sums`'s device."""
    device = collective_device(group)
    moved = sums if sums.device.type == device.type else sums.to(device)
    with not_monitored():  # trainmon's own collective is not part of the training's communication
        dist.all_reduce(moved, group=group)
    return moved.to(sums.device)
