"""DeepSpeed MoE (deepspeed.moe.layer.MoE, top-1 gate) under ZeRO-1/2 with expert parallelism, under TrainerMon.

  DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 job_deepspeed_moe.py --out DIR [--stage 1|2] [--moe-experts 4 --ep 2]

Each expert-parallel rank holds `experts / ep` of the experts, numbered from 0 in its `deepspeed_experts`; every
expert starts from weights of its own (seeded by its global number), so no two ranks' experts are alike. The job
writes the figures of its own tensors under global expert names (`deepspeed_experts.<i + ep_rank × local>`):
weights read from the model itself (ZeRO in fp32 gathers the updated fp32 weights into it), the grads the
inner torch optimizer's step consumes (a step pre-hook saves the flat partitions' grads) and its Adam state,
put together over the group ZeRO partitions each param group over (`real_dp_process_group`: the data-parallel
group for dense parameters, the expert data-parallel group for experts).
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

from common import HIDDEN, VOCAB, Truth, batches, finish, write_config
from trainmon import TrainerMon
from trainmon.hooks.collectives import not_monitored

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--stage", type=int, default=1, choices=[1, 2])
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--moe-experts", type=int, default=4)
parser.add_argument("--ep", type=int, default=2)
parser.add_argument("--moe-load", action="store_true",
                    help="record moe_load, with the gate's own token counts (its dispatch mask and the counts it returns "
                         "beside it, added over the expert-parallel group) in Truth")
parser.add_argument("--capacity", type=float, default=2.0, help="the gate's capacity factor")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
LOCAL_EXPERTS = args.moe_experts // args.ep


class TinyMoELM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=args.moe_experts, ep_size=args.ep, k=1, capacity_factor=args.capacity)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x, y):
        h = self.emb(x)
        out, aux_loss, _ = self.moe(h)
        logits = self.head(h + out)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) + 0.01 * aux_loss


torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
ep_rank = rank % args.ep  # DeepSpeed's expert-parallel groups are runs of `ep` consecutive ranks
torch.manual_seed(0)
model = TinyMoELM()
for i, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
    torch.manual_seed(1000 + ep_rank * LOCAL_EXPERTS + i)
    for layer in expert.modules():
        if isinstance(layer, nn.Linear):
            layer.reset_parameters()
groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": args.stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 6}
engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2),
                                               config=config)
monitor = TrainerMon(write_config(os.path.join(args.out, f"config.rank{rank}.json"), xy_distribution=True,
                                  moe_load=args.moe_load))
gate = model.moe.deepspeed_moe.gate
loads = []  # per forward of the running step: the gate's tokens per expert after the drop, routes before it


def gate_decision(module, inputs, out):
    """Tokens per expert after the drop: from the dispatch mask, or with sparse routes (MOELayer's) from the experts
    the gate names per token (-1 where dropped); and the routes before the drop, the counts it returns beside them."""
    if len(out) == 4:
        received = out[2].sum(dim=(0, 2)).double()
    else:
        chosen = out[3].reshape(-1)
        received = torch.stack([(chosen == e).sum() for e in range(args.moe_experts)]).double()
    loads.append(torch.cat([received, out[-1].sum().double().reshape(1)]))


gate.register_forward_hook(gate_decision)


def record_loads(step):
    merged = sum(loads)
    with not_monitored():
        dist.all_reduce(merged, group=gate.ep_group)
    load = merged[:-1]
    for e, tokens in enumerate(load):
        truth.add(step, "moe_expert_load", f"moe.deepspeed_moe.gate.expert_{e}", tokens)
    truth.add(step, "moe_load", "moe.deepspeed_moe.gate.imbalance", load.max() / load.mean())
    truth.add(step, "moe_load", "moe.deepspeed_moe.gate.idle_experts", (load == 0).sum().double())
    truth.add(step, "moe_load", "moe.deepspeed_moe.gate.dropped_tokens", merged[-1] - load.sum())
    loads.clear()

monitor.set_monitor(engine, optimizer=optimizer)


def global_name(name: str) -> str:
    offset = ep_rank * LOCAL_EXPERTS
    return re.sub(r"deepspeed_experts\.(\d+)", lambda m: f"deepspeed_experts.{int(m.group(1)) + offset}", name)


class Partitions:
    """Whole tensors of model parameters from the fp32 flat partitions of ZeRO 1/2 (`_hp_mapping` says where each
    parameter's fragment lies in its param group's partition), summed over that param group's partition group."""

    def __init__(self):
        self.inner = optimizer.optimizer
        self.consumed = {}  # id of a flat partition: its grad when the inner step that updates it began
        self.inner.register_step_pre_hook(self.save)

    def save(self, inner, *_):
        for group in inner.param_groups:  # ZeRO steps one param group at a time
            for flat in group["params"]:
                self.consumed[id(flat)] = flat.grad.detach().clone()

    def grad(self, p):
        flats = optimizer.single_partition_of_fp32_groups
        return self.whole(p, lambda index: self.consumed[id(flats[index])])

    def whole(self, p, flat_of_group):
        """`p`'s tensor from `flat_of_group(param group index)`, a flat partition's tensor of that param group."""
        mapping = p._hp_mapping
        index = next(i for i, group in enumerate(optimizer.bit16_groups) if any(q is p for q in group))
        out = torch.zeros(p.numel())
        if mapping is not None:
            hp, lp = mapping.get_hp_fragment_address(), mapping.lp_fragment_address
            out[lp.start:lp.start + lp.numel] = flat_of_group(index)[hp.start:hp.start + hp.numel]
        dist.all_reduce(out, group=optimizer.real_dp_process_group[index])
        return out

    def state(self, p, key):
        flats = optimizer.single_partition_of_fp32_groups
        return self.whole(p, lambda index: self.inner.state[flats[index]][key])


truth, partitions = Truth(), Partitions()
data = batches(100 + rank)
named = [(global_name(n[len("module."):]), p) for n, p in engine.named_parameters()]
for step in range(args.steps):
    x, y = next(data)
    engine.backward(engine(x, y))
    for name, p in named:
        truth.add(step, "param_origin", name, p.detach())
    partitions.consumed = {}
    engine.step()
    if args.moe_load:
        record_loads(step)
    with not_monitored():  # the job's own sums over ranks are no part of the training's collectives
        for name, p in named:
            truth.add(step, "grad_reduced", name, partitions.grad(p))
            for key in ("exp_avg", "exp_avg_sq"):
                truth.add(step, key, name, partitions.state(p, key))
            truth.add(step, "param_updated", name, p.detach())

truth.write(args.out, rank)
finish(monitor, args.out, [optimizer])
