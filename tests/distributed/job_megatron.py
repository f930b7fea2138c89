"""Megatron-Core GPT (scripts/train_megatron.py) under TrainerMon, with full tensors gathered for comparison.

  torchrun --nproc_per_node=N job_megatron.py --out DIR [train_megatron.py options: --tp, --pp, --distopt,
      --moe-experts 4 --ep 2]
  # --inject 1:1:1 --inject-module 0:module.decoder.layers.0.mlp.linear_fc1: an inf on rank 1 at step 1,
  # micro-step 1, in that module of chunk 0 (global layer 2 when 2 layers precede it), sentinel and alerts on
  # --inject-grad 1:1: NaN grads of every parameter on rank 1 at step 1, before the DP reduction
  # With --cc and --distopt: comm_truth.rank<R>.json, this rank's figures of the DP reduce-scatter and
  # all-gather buffers, per step and bucket, read from Megatron's buffers.
  # --clip 0.05: Megatron's clip_grad (default the example's 1.0), small enough to bite; also writes monitor.db
  # --moe-load: moe_load and the attention_hook L2 features on, with the routers' own token counts (summed over
  # the step's micro-steps and the expert-parallel group) and the attention features of core_attention's q and k
  # (msprobe's formulas, re-derived) in Truth
  # Always writes steps.rank<R>.json: per step, whether Megatron's optimizer applied the update ("applied"; with
  # --fp16 it skips a step with non-finite grads), and the steps whose grads the inner torch optimizer consumed.

The expected `grad_reduced` is what the inner torch optimizer's step sees (a step pre-hook on it reads the main
params' grads); `grad_preclip` is the DP mean of the ranks' grads, computed here before Megatron reduces them.
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
from common import CC_MODES, Truth, finish, inject_inf, injection_config, write_config
import trainmon
from trainmon import TrainerMon
from trainmon.hooks.collectives import not_monitored

own = argparse.ArgumentParser()
own.add_argument("--out", required=True)
own.add_argument("--cc", nargs="?", const="on", default="off", choices=list(CC_MODES),
                 help="record collectives and p2p ops (cc_distribution): on, or no-inputs (cc_pre_hook off)")
own.add_argument("--inject", metavar="RANK:STEP[:MICRO]", help="put an inf into a module's output there")
own.add_argument("--inject-module", metavar="CHUNK:PATH", help="where --inject puts it (default: the last chunk's "
                 "last layer); PATH as the chunk's named_modules() names it")
own.add_argument("--inject-grad", metavar="RANK:STEP", help="NaN grads of every parameter there")
own.add_argument("--xy", action="store_true", help="also record activations and their grads (xy_distribution)")
own.add_argument("--clip", type=float, help="Megatron's clip_grad (default: the example's)")
own.add_argument("--moe-load", action="store_true", help="record moe_load and attention features; their truth")
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
if known.inject_grad:
    bad_rank, bad_step = (int(v) for v in known.inject_grad.split(":"))
    for chunk in chunks:
        for p in chunk.parameters():
            p.register_hook(lambda g: g * float("nan") if rank == bad_rank and step == bad_step else g)
extra = injection_config() if known.inject or known.inject_grad else {}
if known.xy:
    extra = dict(xy_distribution=True)
if known.clip is not None:
    for chained in optimizer.chained_optimizers:
        chained.config.clip_grad = known.clip
    extra["format"] = ["csv", "db"]  # the clipping scalars are in the database
if known.moe_load:
    extra.update(moe_load=True, recording_l2_features=True,
                 l2_targets={"attention_hook": [n for chunk in chunks for n, _ in chunk.named_modules()
                                                if n.endswith("core_attention")]})
monitor = TrainerMon(write_config(os.path.join(out, f"config.rank{rank}.json"), cc_distribution=CC_MODES[known.cc],
                                  mg_direction=True, **extra))
from megatron.core.distributed import param_and_grad_buffer

BOUND = ("dist_reduce_scatter_func", "dist_all_gather_func", "_coalescing_manager")  # bound by Megatron at import
bound_before = {name: getattr(param_and_grad_buffer, name) for name in BOUND}
monitor.set_monitor(chunks, optimizer=optimizer, grad_acc_steps=args.micro_batches)
repointed = sorted(name for name in BOUND if getattr(param_and_grad_buffer, name) is not bound_before[name])
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


# (Float16Module wraps the model once more under --bf16 and --fp16; MoE layers have no dense fc1 to save)
fc1 = next((m for n, m in chunks[0].named_modules() if n.endswith("decoder.layers.0.mlp.linear_fc1")), None)
if fc1 is not None:
    fc1.register_forward_hook(save_fc1)



def global_names(chunk):
    """(name, param) with Megatron's global layer numbers (each stage and chunk numbers its layers from 0) and
    global expert numbers (each expert-parallel rank numbers its experts from 0)."""
    layers = {name: f"{name.rsplit('.', 1)[0]}.{module.layer_number - 1}" for name, module in chunk.named_modules()
              if hasattr(module, "layer_number") and name.rsplit(".", 1)[-1].isdigit()}
    ep_rank = ps.get_expert_model_parallel_rank()
    experts = {f"{name}.local_experts.{i}": f"{name}.local_experts.{i + ep_rank * len(module.local_experts)}"
               for name, module in chunk.named_modules() if hasattr(module, "local_experts")
               for i in range(len(module.local_experts))}
    for name, param in chunk.named_parameters():
        for renames in (experts, layers):  # experts first: their prefixes hold the local layer number
            local = next((prefix for prefix in renames if name.startswith(prefix + ".")), None)
            name = renames[local] + name[len(local):] if local else name
        yield name, param


# Names as trainmon writes them (squash_name), with "<chunk>:" for virtual pipeline chunks after the first.
named = [((f"{vpp}:" if vpp else "") + ".".join(p for p in n.split(".") if p != "module"), p)
         for vpp, chunk in enumerate(chunks) for n, p in global_names(chunk)]
dp_size = ps.get_data_parallel_world_size()
truth = Truth()
reduced = {}  # name: the full reduced grad of the running step


def groups(param):
    """(TP group, DP group) of a parameter: experts under expert parallelism (Megatron marks them
    allreduce=False) are split and replicated over the expert groups."""
    if getattr(param, "allreduce", True):
        return ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    return ps.get_expert_tensor_parallel_group(), ps.get_expert_data_parallel_group()


def tp_full(param, tensor):
    """The whole parameter's tensor from this TP rank's shard (all-gather along the partition dim)."""
    tp_group = groups(param)[0]
    if not getattr(param, "tensor_model_parallel", False) or tp_group.size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(tp_group.size())]
    dist.all_gather(parts, tensor.contiguous(), group=tp_group)
    return torch.cat(parts, dim=param.partition_dim)


def dp_full(param, shard, param_range):
    """The parameter's tensor from this DP rank's DistributedOptimizer shard (sum of zero-padded shards)."""
    flat = torch.zeros(param.numel(), dtype=torch.float32)
    if shard is not None:
        flat[param_range.start:param_range.end] = shard.detach().float()
    dist.all_reduce(flat, group=groups(param)[1])
    return flat.view(param.shape)


config = chunks[0].config
finalize = config.finalize_model_grads_func
buckets = [bucket for chunk in chunks for group in chunk.bucket_groups for bucket in group.buckets]
comm_truth = {}  # {step: {"reduce_scatter_input"|"reduce_scatter_output"|"all_gather_output": [norm per bucket]}}


def record_buffers(at_step, key, tensors) -> None:
    comm_truth.setdefault(str(at_step), {})[key] = [float(t.double().norm()) for t in tensors]


def finalize_and_record(*a, **k):
    """Before Megatron reduces the grads: the local (unreduced) ones, and their DP mean computed here (the job's
    own collectives are not part of the training: not recorded)."""
    with not_monitored():
        for name, p in named:
            local = p.main_grad.detach().clone()
            truth.add(step, "grad_unreduced", name, tp_full(p, local))
            # Megatron's reduced grad is the sum over the (expert) DP group over the data-parallel size
            dist.all_reduce(local, group=groups(p)[1])
            reduced[name] = tp_full(p, local / dp_size)
            truth.add(step, "grad_preclip", name, reduced[name])
    if args.distopt and args.overlap:  # the params were gathered in this step's forward
        record_buffers(step, "all_gather_output", [b.param_data for b in buckets])
    elif args.distopt:  # overlapped, the reduce-scatter would have begun in backward
        # Megatron scales the grads by 1/DP before reducing them (sum)
        record_buffers(step, "reduce_scatter_input", [b.grad_data * b.gradient_scaling_factor for b in buckets])
    done = finalize(*a, **k)
    if args.distopt:
        record_buffers(step, "reduce_scatter_output", [b.grad_data.chunk(dp_size)[ps.get_data_parallel_rank()]
                                                       for b in buckets])
    return done


config.finalize_model_grads_func = finalize_and_record
# One chained optimizer for dense parameters, and under expert parallelism one for experts.
chained_of = {p: chained for chained in optimizer.chained_optimizers for g in chained.optimizer.param_groups
              for p in g["params"]}
# Without DistributedOptimizer, bf16 (Float16OptimizerWithFloat16Params) keeps Adam state on fp32 copies.
main_of = {p: main for chained in optimizer.chained_optimizers
           for model_group, main_group in zip(getattr(chained, "float16_groups", []),
                                              getattr(chained, "fp32_from_float16_groups", []))
           for p, main in zip(model_group, main_group)}


consumed_at = set()


def record_consumed(inner, *_):
    """The grads the inner torch optimizers are about to consume: their main params' (shards') .grad, as full
    tensors. Megatron's ChainedOptimizer unscales and clips every optimizer's grads before the first one steps."""
    if step in consumed_at:
        return
    consumed_at.add(step)
    with not_monitored():
        for name, p in named:
            if args.distopt:  # the optimizer holding a shard of it here, if any
                owner = next((c for c in optimizer.chained_optimizers if p in c.model_param_group_index_map), None)
                shard = None
                if owner is not None:
                    group, index = owner.model_param_group_index_map[p]
                    shard = owner.optimizer.param_groups[group]["params"][index].grad
                full = dp_full(p, shard, owner._get_model_param_range_map(p)["param"] if owner else None)
            else:
                full = main_of.get(p, p).grad
            truth.add(step, "grad_reduced", name, tp_full(p, full))


for chained in optimizer.chained_optimizers:
    chained.optimizer.register_step_pre_hook(record_consumed)


def record_optimizer_state(step):
    for name, p in named:
        for key in ("param", "exp_avg", "exp_avg_sq"):  # the fp32 main param (param_updated) and Adam state
            if args.distopt:  # the optimizer holding a shard of it here, if any
                owner = next((c for c in optimizer.chained_optimizers if p in c.model_param_group_index_map), None)
                shard = owner._get_main_param_and_optimizer_states(p)[key] if owner else None
                full = dp_full(p, shard, owner._get_model_param_range_map(p)["param"] if owner else None)
            else:
                main = main_of.get(p, p)
                full = main.detach() if key == "param" else chained_of[main].optimizer.state[main][key]
            full = tp_full(p, full)
            truth.add(step, "param_updated" if key == "param" else key, name, full)
            if key == "exp_avg":
                truth.add_sign_agreement(step, name, reduced[name], full)


class RouterTruth:
    """The routers' own decisions (the routing map each returns) and the attention features of core_attention's q
    and k, per layer under its global number; token counts summed over the step and the expert-parallel group."""

    def __init__(self):
        self.loads = {}  # router name: [tokens per expert, routes before the drop] of the running step
        self.micro = {}  # core_attention name: its micro-step in the running step
        for chunk in chunks:
            for module in chunk.modules():
                if hasattr(module, "layer_number") and hasattr(module, "self_attention"):
                    layer = f"decoder.layers.{module.layer_number - 1}"
                    if hasattr(module.mlp, "router"):
                        module.mlp.router.register_forward_hook(self.routed(f"{layer}.mlp.router"))
                    module.self_attention.core_attention.register_forward_hook(
                        self.attended(f"{layer}.self_attention.core_attention"))

    def routed(self, name):
        def hook(router, inputs, output):
            if router.training and torch.is_grad_enabled():
                routing_map = output[1]
                load, routes = self.loads.get(name, (0, 0))
                self.loads[name] = (load + routing_map.sum(dim=0).double(), routes + routing_map.shape[0] * router.topk)
        return hook

    def attended(self, name):
        def hook(module, inputs, output):
            if not (module.training and torch.is_grad_enabled()):
                return
            micro = self.micro[name] = self.micro.get(name, -1) + 1
            q, k = inputs[0][:, 0, 0].double(), inputs[1][:, 0, 0].double()  # head 0 of sequence 0
            logits = q @ k.t() / q.shape[-1] ** 0.5
            causal = torch.ones_like(logits, dtype=torch.bool).tril()
            p = logits.masked_fill(~causal, -float("inf")).softmax(-1)
            figures = {"entropy": -(p * torch.where(p > 0, p.log(), 0)).sum(-1).mean(),
                       "softmax_max": p.max(-1).values.mean(), "max_logit": logits[causal].max()}
            for feature, value in figures.items():
                truth.add(step, "attention_hook", f"{name}.{feature}", value, micro=micro)
        return hook

    def end_step(self, at_step):
        with not_monitored():
            for name, (load, routes) in sorted(self.loads.items()):
                merged = torch.cat([load, torch.tensor([float(routes)], dtype=torch.float64)])
                dist.all_reduce(merged, group=ps.get_expert_model_parallel_group())
                load = merged[:-1]
                for e, tokens in enumerate(load):
                    truth.add(at_step, "moe_expert_load", f"{name}.expert_{e}", tokens)
                truth.add(at_step, "moe_load", f"{name}.imbalance", load.max() / load.mean())
                truth.add(at_step, "moe_load", f"{name}.idle_experts", (load == 0).sum().double())
                truth.add(at_step, "moe_load", f"{name}.dropped_tokens", merged[-1] - load.sum())
        self.loads, self.micro = {}, {}


router_truth = RouterTruth() if known.moe_load else None
data = train_megatron.data_iterators(args, chunks)
applied = {}
for step in range(args.steps):
    applied[step] = train_megatron.train_step(args, chunks, optimizer, data)[1]
    if router_truth is not None:
        router_truth.end_step(step)
    if args.distopt and not args.overlap:  # gathered in the optimizer's step
        record_buffers(step, "all_gather_output", [b.param_data for b in buckets])
    with not_monitored():
        record_optimizer_state(step)

monitor.stop()
with open(os.path.join(out, f"bindings.rank{rank}.json"), "w") as f:
    json.dump({"repointed": repointed, "restored": all(getattr(param_and_grad_buffer, name) is bound_before[name]
                                                       for name in BOUND)}, f)
with open(os.path.join(out, f"steps.rank{rank}.json"), "w") as f:
    json.dump({"applied": applied, "consumed": sorted(consumed_at)}, f)
truth.write(out, rank)
with open(os.path.join(out, f"comm_truth.rank{rank}.json"), "w") as f:
    json.dump(comm_truth, f)
routers = [m for chunk in chunks for m in chunk.modules() if type(m).__name__ == "TopKRouter"]
finish(monitor, out, [optimizer] + routers + [group for chunk in chunks
                                              for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups])
