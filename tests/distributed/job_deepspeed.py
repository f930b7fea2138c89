"""DeepSpeed ZeRO-0/1/2/3 training of a tiny LM under TrainerMon, with the full tensors gathered for comparison.

  DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 job_deepspeed.py --stage 0|1|2|3 --out DIR

Under ZeRO-0 every rank holds whole tensors (DeepSpeed's safe_get_full_* give none): they are read directly,
and gradient clipping is off unless `--clip` sets it, so the reduced grads are the plain mean of the ranks' own
grads. `--clip C` sets `gradient_clipping` (default 1.0 with ZeRO 1-3) and adds monitor.db to the output.

The expected `grad_reduced` is what the inner torch optimizer's step sees: a step pre-hook on it saves the
(flat partitions') grads, assembled into full tensors after the step with DeepSpeed's fragment bookkeeping.
`grad_preclip` is the full grad before the step (safe_get_full_grad).
"""
import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

from common import (CC_MODES, LocalGrads, SavedLogits, TinyLM, Truth, batches, finish, inject_inf, injection_config,
                    write_config)
from trainmon import TrainerMon
from trainmon.hooks.collectives import not_monitored

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--bf16", action="store_true", help="bf16 weights; with --stage 1, DeepSpeed's BF16_Optimizer")
parser.add_argument("--inject", metavar="RANK:STEP[:MICRO]", help="put an inf into blocks.0's output there")
parser.add_argument("--cc", default="off", choices=list(CC_MODES), help="cc_distribution: off, on, or no-inputs")
parser.add_argument("--clip", type=float, help="gradient_clipping (default: 1.0 with ZeRO 1-3, off with ZeRO-0)")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
model = TinyLM()
replica = copy.deepcopy(model)  # without data parallelism: its grads are this rank's unreduced ones
saved_logits = model.saves = SavedLogits()
zero = {"stage": args.stage}
if args.stage == 3:
    zero["stage3_param_persistence_threshold"] = 0  # else a tiny model is not partitioned at all
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "gradient_clipping": args.clip if args.clip is not None else (1.0 if args.stage else 0.0),
          "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 6,
          "bf16": {"enabled": args.bf16}}
if args.bf16 and args.stage == 1:
    config["data_types"] = {"grad_accum_dtype": "fp32"}  # DeepSpeed picks its BF16_Optimizer
engine, optimizer, _, _ = deepspeed.initialize(
    model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
rank = dist.get_rank()
step = 0
if args.inject:  # the module's output as the monitor sees it carries the inf
    inject_inf(engine.module.blocks[0], args.inject, rank, lambda: step)
extra = injection_config() if args.inject else {}
if args.clip is not None:
    extra["format"] = ["csv", "db"]  # the clipping scalars are in the database
monitor = TrainerMon(write_config(os.path.join(args.out, f"config.rank{rank}.json"), mg_direction=True,
                                  cc_distribution=CC_MODES[args.cc], **extra))
monitor.set_monitor(engine, optimizer=optimizer)



def full_param(p):
    return p.detach() if args.stage == 0 else safe_get_full_fp32_param(p)


def full_grad(p):
    return p.grad.detach().clone() if args.stage == 0 else safe_get_full_grad(p)  # ZeRO-0 zeroes it in step()


def full_state(p, key):
    return optimizer.state[p][key] if args.stage == 0 else safe_get_full_optimizer_state(p, key)


class ConsumedGrads:
    """The grads the inner torch optimizer's step() calls see (a step pre-hook saves them), as full tensors."""

    def __init__(self):
        self.inner = optimizer if args.stage == 0 else optimizer.optimizer
        self.saved = {}  # id(stepped tensor): its grad when a step() of this training step began
        self.inner.register_step_pre_hook(self.save)

    def save(self, inner, *_):
        for group in inner.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.saved[id(p)] = p.grad.detach().clone()

    def full(self, p):
        """The full grad of model parameter `p` that the inner optimizer consumed in the step just taken."""
        if args.stage == 0:
            return self.saved[id(p)]
        flat = torch.zeros(p.ds_numel if args.stage == 3 else p.numel())
        if args.stage == 3:
            sub_group, offset, numel = optimizer.grad_position[optimizer.get_param_id(p)]
            start = dist.get_rank() * numel  # each rank's partition holds `numel` elements of p (the last: padding)
            valid = max(0, min(numel, p.ds_numel - start))
            grad = self.saved[id(optimizer.fp32_partitioned_groups_flat[sub_group])][offset:offset + valid]
            flat[start:start + valid] = grad
        elif p._hp_mapping is not None:
            partitions = getattr(optimizer, "single_partition_of_fp32_groups", None) or optimizer.fp32_groups_flat_partition
            grad = self.saved[id(partitions[p._hp_mapping.param_group_index])]
            hp, lp = p._hp_mapping.get_hp_fragment_address(), p._hp_mapping.lp_fragment_address
            flat[lp.start:lp.start + lp.numel] = grad[hp.start:hp.start + hp.numel]
        dist.all_reduce(flat)
        return flat

    def clear(self):
        self.saved = {}


truth, local, consumed = Truth(), LocalGrads(), ConsumedGrads()
data = batches(100 + rank)
named = [(n[len("module."):], p) for n, p in engine.named_parameters()]
for step in range(args.steps):
    x, y = next(data)
    with not_monitored():  # the job's own gathers of full tensors are no part of the training's collectives
        replica.load_state_dict({n: full_param(p).reshape(replica.get_parameter(n).shape) for n, p in named},
                                strict=False)
    replica.zero_grad(set_to_none=True)
    replica(x, y).backward()
    for name, p in replica.named_parameters():
        truth.add(step, "grad_unreduced", name, p.grad)
        local.add(step, name, p.grad)
    engine.backward(engine(x, y))
    saved_logits.add_to(truth, step)
    with not_monitored():
        grads = {name: full_grad(p) for name, p in named}
        for name, p in named:
            truth.add(step, "grad_preclip", name, grads[name])
            truth.add(step, "param_origin", name, full_param(p))
    consumed.clear()
    engine.step()
    with not_monitored():
        for name, p in named:
            if consumed.saved:  # else DeepSpeed skipped the step (a non-finite grad norm): nothing was consumed
                truth.add(step, "grad_reduced", name, consumed.full(p))
            for key in ("exp_avg", "exp_avg_sq"):
                truth.add(step, key, name, full_state(p, key))
            truth.add(step, "param_updated", name, full_param(p))
            truth.add_sign_agreement(step, name, grads[name], full_state(p, "exp_avg"))

truth.write(args.out, rank)
local.write(args.out, rank)
finish(monitor, args.out, [optimizer])
