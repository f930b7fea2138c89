"""DeepSpeed mixture of experts (`deepspeed.moe.layer.MoE`) under expert parallelism.

Each expert-parallel rank holds `num_local_experts` of a layer's experts, numbered from 0 in its `Experts`
module (`deepspeed_experts.<i>`), so with 4 experts on EP2 rank 1's `deepspeed_experts.0` is global expert 2
(the index DeepSpeed's checkpoints give it): names get `i + ep_rank × num_local_experts`. DeepSpeed marks the
experts' parameters `allreduce=False` with the `group_name` of their expert groups; ZeRO partitions them over
that group's expert data-parallel group (`real_dp_process_group` of their `moe` param group), not the dense
one, so that is where their pieces merge.
"""
from __future__ import annotations

import torch

from trainmon.adapters.base import group_coordinates
from trainmon.adapters.naming import renumber
from trainmon.adapters.naming import display_name

_CONTAINER = "deepspeed_experts"


def is_expert(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "allreduce", True) and hasattr(param, "group_name")


class ExpertNumbering:
    """Global expert numbers of the `Experts` modules in model chunks (none without DeepSpeed MoE)."""

    def __init__(self, chunks: list[torch.nn.Module]):
        # Keyed by the module's name with wrapper components taken out, which is how it is found whether or
        # not the monitor squashes names.
        self._offsets: dict[str, int] = {}
        self.coordinates: dict = {}
        for chunk in chunks:
            for name, module in chunk.named_modules():
                experts = getattr(module, _CONTAINER, None)
                if not isinstance(experts, torch.nn.ModuleList) or not hasattr(module, "num_local_experts"):
                    continue
                param = next((p for p in module.parameters() if is_expert(p)), None)
                if param is None:
                    continue
                from deepspeed.utils import groups

                ep_rank = groups._get_expert_parallel_rank(param.group_name)
                self._offsets[display_name(name, True)] = ep_rank * module.num_local_experts
                self.coordinates.setdefault(param.group_name, _coordinates(groups, param.group_name))

    def rename(self, name: str) -> str:
        """`deepspeed_experts.<i>` with the global expert number."""
        marker = f"{_CONTAINER}."
        at = name.find(marker)
        if at < 0 or not self._offsets:
            return name
        head = name[:at].rstrip(".")
        offset = self._offsets.get(display_name(head, True), 0)
        return name[:at] + renumber(name[at:], _CONTAINER, offset)


def _coordinates(groups, group_name: str) -> dict:
    return {"ep": group_coordinates(groups._get_expert_parallel_group(group_name)),
            "edp": group_coordinates(groups._get_expert_data_parallel_group(group_name))}
