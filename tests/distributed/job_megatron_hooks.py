"""Megatron-Core GPT (scripts/train_megatron.py) under TrainerMon with activations, their grads and the NaN
sentinel for many steps: the tensor hooks left on parameters after each step, and after stop().

  torchrun --nproc_per_node=N job_megatron_hooks.py --out DIR [train_megatron.py options: --tp, --steps]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "scripts")]

import torch
import torch.distributed as dist

import train_megatron
from common import finish, write_config
from trainmon import TrainerMon

own = argparse.ArgumentParser()
own.add_argument("--out", required=True)
known, rest = own.parse_known_args()
args = train_megatron.parse_args(rest)
torch.set_num_threads(1)
chunks, optimizer = train_megatron.setup(args)
rank = dist.get_rank()
monitor = TrainerMon(write_config(os.path.join(known.out, f"config.rank{rank}.json"), xy_distribution=True,
                                  sentinel=True, ops=["norm", "nans"], step_count_per_record=args.steps))
monitor.set_monitor(chunks, optimizer=optimizer, grad_acc_steps=args.micro_batches)


def live_parameter_hooks() -> int:
    """Tensor hooks on the model's parameters (Megatron's linear layers return their bias Parameter)."""
    return sum(len(p._backward_hooks or {}) for chunk in chunks for p in chunk.parameters())


data = train_megatron.batches(args)
per_step = []
for _ in range(args.steps):
    train_megatron.train_step(args, chunks, optimizer, data)
    per_step.append(live_parameter_hooks())
monitor.stop()
with open(os.path.join(known.out, f"hooks.rank{rank}.json"), "w") as f:
    json.dump({"per_step": per_step, "after_stop": live_parameter_hooks(),
               "forward_hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
                                    for chunk in chunks for m in chunk.modules())}, f)
finish(monitor)
