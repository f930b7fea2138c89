"""DDP or FSDP2 training of a tiny LM under TrainerMon, with the figures computed directly for comparison.

  torchrun --nproc_per_node=2 job_torch.py --mode ddp|fsdp2 --out DIR [--micro-batches N]

With FSDP2 the unreduced grads are recorded per micro-batch; with several micro-batches, odd steps
accumulate all but the last without reduce-scattering (`set_requires_gradient_sync(False)`).
"""
import argparse
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist

from common import LocalGrads, SavedLogits, TinyLM, Truth, batches, finish, inject_inf, injection_config, write_config
from trainmon import TrainerMon

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["ddp", "fsdp2"], required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--micro-batches", type=int, default=1, help="per step (fsdp2 only)")
parser.add_argument("--inject", metavar="RANK:STEP", help="put an inf into blocks.0's output on RANK at STEP")
parser.add_argument("--cc", action="store_true", help="record collectives (cc_distribution)")
parser.add_argument("--module-ranks", type=int, nargs="*", default=[], help="the config's module_ranks")
parser.add_argument("--output-filesystem", help="with --inject: the config's output_filesystem, and the anomaly "
                                                "processor on (common.injection_config)")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = TinyLM()
replica = copy.deepcopy(model)  # the same model without data parallelism: its grads are this rank's unreduced ones
saved_logits = model.saves = SavedLogits()
if args.mode == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(model)
else:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
unsharded = {}  # FSDP2's unsharded parameters, as its modules hold them during forward


def keep_unsharded(module, inputs):
    unsharded.update((id(p), p) for p in module.parameters() if not hasattr(p, "device_mesh"))


if args.mode == "fsdp2":
    for module in model.modules():
        module.register_forward_pre_hook(keep_unsharded)
pre_hook_count = sum(len(m._forward_pre_hooks) for m in model.modules())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
step = 0
if args.inject:  # the module's output as the monitor sees it carries the inf
    inject_inf((model.module if args.mode == "ddp" else model).blocks[0], args.inject, rank, lambda: step)
extra = dict(xy_distribution=True, forward_only=True, format=["csv", "db"]) if args.inject else {}
if args.output_filesystem:
    extra = dict(injection_config(), output_filesystem=args.output_filesystem)
if args.module_ranks:
    extra = dict(xy_distribution=True)
monitor = TrainerMon(write_config(os.path.join(args.out, f"config.rank{rank}.json"), module_ranks=args.module_ranks,
                                  cc_distribution={"enable": args.cc}, **extra))
monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=args.micro_batches)

truth, local = Truth(), LocalGrads()
data = batches(100 + rank)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def squash(name):
    return ".".join(p for p in name.split(".") if p not in ("module", "_fsdp_wrapped_module"))


for step in range(args.steps):
    replica.load_state_dict({k: full(v) for k, v in model.state_dict().items()} if args.mode == "fsdp2"
                            else model.module.state_dict())
    for micro in range(args.micro_batches):
        x, y = next(data)
        if args.mode == "fsdp2":
            model.set_requires_gradient_sync(step % 2 == 0 or micro == args.micro_batches - 1)
        replica.zero_grad(set_to_none=True)
        replica(x, y).backward()
        model(x, y).backward()
        saved_logits.add_to(truth, step, micro)
        for name, p in replica.named_parameters():
            truth.add(step, "grad_unreduced", name, p.grad, micro=micro if args.mode == "fsdp2" else None)
            local.add(step, name, p.grad)
    for name, p in model.named_parameters():
        truth.add(step, "grad_reduced", squash(name), full(p.grad))
        truth.add(step, "param_origin", squash(name), full(p.detach()))
    optimizer.step()
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        truth.add(step, "exp_avg", squash(name), full(state["exp_avg"]))
        truth.add(step, "exp_avg_sq", squash(name), full(state["exp_avg_sq"]))
        truth.add(step, "param_updated", squash(name), full(p.detach()))
    optimizer.zero_grad(set_to_none=True)

truth.write(args.out, rank)
local.write(args.out, rank)
monitor.stop()
with open(os.path.join(args.out, f"hooks.rank{rank}.json"), "w") as f:  # what stop() left behind
    json.dump({"unsharded": len(unsharded), "hooked": sum(bool(p._backward_hooks) for p in unsharded.values()),
               "pre_hooks_added": sum(len(m._forward_pre_hooks) for m in model.modules()) - pre_hook_count}, f)
finish(monitor)
