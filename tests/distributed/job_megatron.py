"""Megatron-Core GPT (scripts/train_megatron.py) under TrainerMon, with full tensors gathered for comparison.

  torchrun --nproc_per_node=N job_megatron.py --out DIR [train_megatron.py options: --tp, --pp, --distopt]
  # --inject 1:1:1 --inject-module 0:module.decoder.layers.0.mlp.linear_fc1: an inf on rank 1 at step 1,
  # micro-step 1, in that module of chunk 0 (global layer 2 when 2 layers precede it), sentinel and alerts on
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "scripts")]

import torch
import torch.distributed as dist

import train_megatron
from common import CC_MODES, Truth, finish, inject_inf, injection_config, write_config
import trainmon
from trainmon import TrainerMon

own = argparse.ArgumentParser()
own.add_argument("--out", required=True)
own.add_argument("--cc", nargs="?", const="on", default="off", choices=list(CC_MODES),
                 help="record collectives and p2p ops (cc_distribution): on, or no-inputs (cc_pre_hook off)")
own.add_argument("--inject", metavar="RANK:STEP[:MICRO]", help="put an inf into a module's output there")
own.add_argument("--inject-module", metavar="CHUNK:PATH", help="where --inject puts it (default: the last chunk's "
                 "last layer); PATH as the chunk's named_modules() names it")
own.add_argument("--xy", action="store_true", help="also record activations and their grads (xy_distribution)")
known, rest = own.parse_known_args()
out = known.out
args = train_megatron.parse_args(rest + ["--steps", "3"])
torch.set_num_threads(1)
chunks, optimizer = train_megatron.setup(args)
from megatron.core import parallel_state as ps

rank = dist.get_rank()
step = 0
if known.inject:  # the module's output as the monitor sees it carries the inf
    if known.inject_module:
        chunk, _, path = known.inject_module.partition(":")
        target = dict(chunks[int(chunk)].named_modules())[path]
    else:
        target = chunks[-1].module.decoder.layers[-1]
    inject_inf(target, known.inject, rank, lambda: step)
extra = injection_config() if known.inject else {}
if known.xy:
    extra = dict(xy_distribution=True)
monitor = TrainerMon(write_config(os.path.join(out, f"config.rank{rank}.json"), cc_distribution=CC_MODES[known.cc],
                                  mg_direction=True, **extra))
monitor.set_monitor(chunks, optimizer=optimizer, grad_acc_steps=args.micro_batches)
saved_micro = {"step": -1, "micro": -1}


def save_fc1(module, inputs, output):
    """The first decoder layer's fc1 output (a local TP shard) to trainmon.save / save_grad, from a forward hook
    as a script would save it, with its norm and its grad's in Truth per micro-step."""
    if not (module.training and torch.is_grad_enabled()):
        return
    if saved_micro["step"] != step:
        saved_micro.update(step=step, micro=-1)
    saved_micro["micro"] += 1
    where = (step, saved_micro["micro"])
    tensor = output[0] if isinstance(output, tuple) else output
    trainmon.save("fc1_out", tensor)
    trainmon.save_grad("fc1_out", tensor)
    truth.add(where[0], "save", "fc1_out", tensor, micro=where[1])
    tensor.register_hook(lambda grad: truth.add(where[0], "save_grad", "fc1_out", grad, micro=where[1]))


chunks[0].module.decoder.layers[0].mlp.linear_fc1.register_forward_hook(save_fc1)



def global_names(chunk):
    """(name, param) with Megatron's global layer numbers (each stage and chunk numbers its layers from 0)."""
    layers = {name: f"{name.rsplit('.', 1)[0]}.{module.layer_number - 1}" for name, module in chunk.named_modules()
              if hasattr(module, "layer_number") and name.rsplit(".", 1)[-1].isdigit()}
    for name, param in chunk.named_parameters():
        local = next((prefix for prefix in layers if name.startswith(prefix + ".")), None)
        yield (layers[local] + name[len(local):] if local else name), param


# Names as trainmon writes them (squash_name), with "<chunk>:" for virtual pipeline chunks after the first.
named = [((f"{vpp}:" if vpp else "") + ".".join(p for p in n.split(".") if p != "module"), p)
         for vpp, chunk in enumerate(chunks) for n, p in global_names(chunk)]
dp_group, dp_size = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
truth = Truth()
reduced = {}  # name: the full reduced grad of the running step


def tp_full(param, tensor):
    """The whole parameter's tensor from this TP rank's shard (all-gather along the partition dim)."""
    if not getattr(param, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=param.partition_dim)


def dp_full(param, shard, param_range):
    """The parameter's tensor from this DP rank's DistributedOptimizer shard (sum of zero-padded shards)."""
    flat = torch.zeros(param.numel(), dtype=torch.float32)
    if shard is not None:
        flat[param_range.start:param_range.end] = shard.detach().float()
    dist.all_reduce(flat, group=dp_group)
    return flat.view(param.shape)


config = chunks[0].config
finalize = config.finalize_model_grads_func


def finalize_and_record(*a, **k):
    """Before Megatron reduces the grads: the local (unreduced) ones, and their DP mean computed here."""
    for name, p in named:
        local = p.main_grad.detach().clone()
        truth.add(step, "grad_unreduced", name, tp_full(p, local))
        dist.all_reduce(local, group=dp_group)
        reduced[name] = tp_full(p, local / dp_size)
        truth.add(step, "grad_reduced", name, reduced[name])
    return finalize(*a, **k)


config.finalize_model_grads_func = finalize_and_record
(chained,) = optimizer.chained_optimizers
# Without DistributedOptimizer, bf16 (Float16OptimizerWithFloat16Params) keeps Adam state on fp32 copies.
main_of = {p: main for model_group, main_group in zip(getattr(chained, "float16_groups", []),
                                                      getattr(chained, "fp32_from_float16_groups", []))
           for p, main in zip(model_group, main_group)}
data = train_megatron.data_iterators(args, chunks)
for step in range(args.steps):
    train_megatron.train_step(args, chunks, optimizer, data)
    for name, p in named:
        for key in ("exp_avg", "exp_avg_sq"):
            if args.distopt:
                owned = p in chained.model_param_group_index_map
                shard = chained._get_main_param_and_optimizer_states(p)[key] if owned else None
                full = dp_full(p, shard, chained._get_model_param_range_map(p)["param"] if owned else None)
            else:
                full = chained.optimizer.state[main_of.get(p, p)][key]
            full = tp_full(p, full)
            truth.add(step, key, name, full)
            if key == "exp_avg":
                truth.add_sign_agreement(step, name, reduced[name], full)

truth.write(out, rank)
finish(monitor, out, [optimizer] + [group for chunk in chunks for group in chunk.bucket_groups])
