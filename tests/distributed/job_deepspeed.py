"""DeepSpeed ZeRO-0/1/2/3 training of a tiny LM under TrainerMon, with the full tensors gathered for comparison.

  DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 job_deepspeed.py --stage 0|1|2|3 --out DIR

Under ZeRO-0 every rank holds whole tensors (DeepSpeed's safe_get_full_* give none): they are read directly,
and gradient clipping is off, so the reduced grads are the plain mean of the ranks' own grads.
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

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--bf16", action="store_true", help="bf16 weights; with --stage 1, DeepSpeed's BF16_Optimizer")
parser.add_argument("--inject", metavar="RANK:STEP[:MICRO]", help="put an inf into blocks.0's output there")
parser.add_argument("--cc", default="off", choices=list(CC_MODES), help="cc_distribution: off, on, or no-inputs")
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
          "gradient_clipping": 1.0 if args.stage else 0.0,
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
monitor = TrainerMon(write_config(os.path.join(args.out, f"config.rank{rank}.json"), mg_direction=True,
                                  cc_distribution=CC_MODES[args.cc], **extra))
monitor.set_monitor(engine, optimizer=optimizer)



def full_param(p):
    return p.detach() if args.stage == 0 else safe_get_full_fp32_param(p)


def full_grad(p):
    return p.grad.detach().clone() if args.stage == 0 else safe_get_full_grad(p)  # ZeRO-0 zeroes it in step()


def full_state(p, key):
    return optimizer.state[p][key] if args.stage == 0 else safe_get_full_optimizer_state(p, key)


truth, local = Truth(), LocalGrads()
data = batches(100 + rank)
named = [(n[len("module."):], p) for n, p in engine.named_parameters()]
for step in range(args.steps):
    x, y = next(data)
    replica.load_state_dict({n: full_param(p).reshape(replica.get_parameter(n).shape) for n, p in named},
                            strict=False)
    replica.zero_grad(set_to_none=True)
    replica(x, y).backward()
    for name, p in replica.named_parameters():
        truth.add(step, "grad_unreduced", name, p.grad)
        local.add(step, name, p.grad)
    engine.backward(engine(x, y))
    saved_logits.add_to(truth, step)
    grads = {name: full_grad(p) for name, p in named}
    for name, p in named:
        truth.add(step, "grad_reduced", name, grads[name])
        truth.add(step, "param_origin", name, full_param(p))
    engine.step()
    for name, p in named:
        for key in ("exp_avg", "exp_avg_sq"):
            truth.add(step, key, name, full_state(p, key))
        truth.add(step, "param_updated", name, full_param(p))
        truth.add_sign_agreement(step, name, grads[name], full_state(p, "exp_avg"))

truth.write(args.out, rank)
local.write(args.out, rank)
finish(monitor, args.out, [optimizer])
