"""DeepSpeed ZeRO-2 training of a tiny LM with a config-check capture and checkpoints.

  DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 job_deepspeed_check.py --out DIR [--lr 1e-2] [--load FILE]
      [--shuffle] [--save-at 0,2]

Writes DIR/pack/rank_<R>.zip (weights at set-up, the inputs of the first 2 micro-steps, RNG states, the
training hyperparameters), DeepSpeed checkpoints DIR/ckpt/global_step<N>, and DIR/truth/global_step<N>.pt:
the full fp32 parameters gathered with DeepSpeed's safe_get_full_fp32_param.
  --load FILE   start from the weights in FILE (a state dict) instead of the seeded initialisation
  --shuffle     permute the samples of every batch (the same data in another order)
"""
import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param

import trainmon.config_check
from common import MBS, TinyLM, batches

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--load")
parser.add_argument("--shuffle", action="store_true")
parser.add_argument("--save-at", default="")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

torch.set_num_threads(1)
random.seed(0)  # a job seeds every generator it uses
np.random.seed(0)
torch.manual_seed(0)
model = TinyLM()
if args.load:
    model.load_state_dict(torch.load(args.load))
engine, optimizer, _, _ = deepspeed.initialize(
    model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr),
    config={"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 6})
rank = dist.get_rank()
# What the job's own hyperparameters are (its test switches, like --shuffle, are not among them).
hyper = argparse.Namespace(lr=args.lr, micro_batch_size=MBS, train_iters=args.steps, seed=0, zero_stage=2)
trainmon.config_check.capture(engine, args=hyper, output=os.path.join(args.out, "pack"), batches=2)
order = torch.randperm(MBS, generator=torch.Generator().manual_seed(7)) if args.shuffle else torch.arange(MBS)


def save(step):
    tag = f"global_step{step}"
    engine.save_checkpoint(os.path.join(args.out, "ckpt"), tag=tag)
    full = {name[len("module."):]: safe_get_full_fp32_param(p).clone() for name, p in engine.named_parameters()}
    if rank == 0:
        os.makedirs(os.path.join(args.out, "truth"), exist_ok=True)
        torch.save(full, os.path.join(args.out, "truth", f"{tag}.pt"))


save_at = {int(s) for s in args.save_at.split(",") if s}
data = batches(100 + rank)
for step in range(args.steps + 1):
    if step in save_at:
        save(step)
    if step < args.steps:
        x, y = next(data)
        engine.backward(engine(x[order], y[order]))
        engine.step()
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
