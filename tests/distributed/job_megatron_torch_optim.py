"""Megatron-Core GPT trained as Megatron-Core's quick-start trains it: torch.optim.AdamW over the unwrapped chunks'
parameters and get_forward_backward_func (scripts/train_megatron.py --optimizer torch), with an inf injected.

  torchrun --nproc_per_node=2 job_megatron_torch_optim.py --out DIR --inject 1:1:1 \
      --inject-module 0:decoder.layers.0.mlp.linear_fc1 [train_megatron.py options: --pp 2 --layers 4]
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "scripts")]

import torch
import torch.distributed as dist

import train_megatron
from common import finish, inject_inf, injection_config, write_config
from trainmon import TrainerMon

own = argparse.ArgumentParser()
own.add_argument("--out", required=True)
own.add_argument("--inject", metavar="RANK:STEP[:MICRO]", required=True, help="put an inf into a module's output")
own.add_argument("--inject-module", metavar="CHUNK:PATH", required=True,
                 help="where --inject puts it; PATH as the chunk's named_modules() names it")
known, rest = own.parse_known_args()
args = train_megatron.parse_args(rest + ["--optimizer", "torch", "--steps", "3"])
torch.set_num_threads(1)
chunks, optimizer = train_megatron.setup(args)
assert type(optimizer) is torch.optim.AdamW
rank = dist.get_rank()
step = 0
chunk, _, path = known.inject_module.partition(":")
inject_inf(dict(chunks[int(chunk)].named_modules())[path], known.inject, rank, lambda: step)
monitor = TrainerMon(write_config(os.path.join(known.out, f"config.rank{rank}.json"), **injection_config()))
monitor.set_monitor(chunks, optimizer=optimizer, grad_acc_steps=args.micro_batches)
data = train_megatron.data_iterators(args, chunks)
for step in range(args.steps):
    train_megatron.train_step(args, chunks, optimizer, data)
finish(monitor)
