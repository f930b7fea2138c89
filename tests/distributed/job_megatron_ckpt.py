"""Megatron-Core GPT (scripts/train_megatron.py) saving checkpoints as Megatron-LM does, plus the full tensors.

  torchrun --nproc_per_node=N job_megatron_ckpt.py --out DIR [--save-at 0,2] [--tp 2 --pp 2 ...]

At each iteration of --save-at it writes, under DIR/legacy, Megatron-LM's legacy layout
(`iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt` with the pickled `args`, numpy RNG state, iteration, and
`latest_checkpointed_iteration.txt`), under DIR/dist/iter_XXXXXXX a `megatron.core.dist_checkpointing`
(torch_dist) directory, and `DIR/truth/iter_XXXXXXX.pp<P>.pt`: the stage's full parameters (TP shards
all-gathered along each parameter's own partition_dim) under global layer numbers. With --capture, a
config-check pack of every rank in DIR/pack.
"""
import argparse
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "scripts")]

import numpy as np
import torch
import torch.distributed as dist

import train_megatron


def global_names(chunk):
    """(name, param) with global layer numbers and without the DDP wrapper's `module.` prefix."""
    modules = dict(chunk.named_modules())
    for name, param in chunk.named_parameters():
        parts = name.split(".")[1:]
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(modules[".".join(["module"] + parts[:3])].layer_number - 1)
        yield ".".join(parts), param


def main() -> None:  # a function: dist-checkpointing's writer starts a process that imports this file
    own = argparse.ArgumentParser()
    own.add_argument("--out", required=True)
    own.add_argument("--save-at", default="0,2", help="iterations to save at (0: before training)")
    own.add_argument("--dist", action="store_true", help="also save dist checkpoints")
    own.add_argument("--capture", action="store_true", help="config-check capture into DIR/pack (1 micro-step)")
    known, rest = own.parse_known_args()
    args = train_megatron.parse_args(rest + ["--steps", "2", "--config", "none"])
    torch.set_num_threads(1)
    chunks, optimizer = train_megatron.setup(args)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    saver = ps.get_data_parallel_rank() == 0
    # What Megatron-LM pickles as `args` (a Namespace of plain values and dtypes).
    megatron_args = argparse.Namespace(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                       num_layers=args.layers or 2 * args.pp, hidden_size=args.hidden, swiglu=False,
                                       lr=1e-3, params_dtype=torch.float32, seq_length=args.seq)

    def full(param):
        if not getattr(param, "tensor_model_parallel", False) or args.tp == 1:
            return param.detach().clone()
        parts = [torch.empty_like(param) for _ in range(args.tp)]
        dist.all_gather(parts, param.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
        return torch.cat(parts, dim=param.partition_dim)

    def save(iteration):
        legacy = os.path.join(known.out, "legacy", f"iter_{iteration:07d}",
                              f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if args.pp > 1 else ""))
        merged = {name: full(p) for name, p in global_names(chunks[0])}  # every TP rank joins the all-gather
        if saver:
            os.makedirs(legacy, exist_ok=True)
            torch.save({"model": chunks[0].module.state_dict_for_save_checkpoint(), "args": megatron_args,
                        "iteration": iteration, "checkpoint_version": 3.0,
                        "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                       "torch_rng_state": torch.get_rng_state()}]},
                       os.path.join(legacy, "model_optim_rng.pt"))
            if tp == 0:
                os.makedirs(os.path.join(known.out, "truth"), exist_ok=True)
                torch.save(merged, os.path.join(known.out, "truth", f"iter_{iteration:07d}.pp{pp}.pt"))
        if known.dist:
            dist_dir = os.path.join(known.out, "dist", f"iter_{iteration:07d}")
            os.makedirs(dist_dir, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(chunks[0].module.sharded_state_dict(), dist_dir)
        if dist.get_rank() == 0:
            with open(os.path.join(known.out, "legacy", "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
        dist.barrier()

    if known.capture:
        import trainmon.config_check
        trainmon.config_check.capture(chunks, args=megatron_args, output=os.path.join(known.out, "pack"), batches=1)
    save_at = {int(i) for i in known.save_at.split(",")}
    data = train_megatron.batches(args)
    for iteration in range(args.steps + 1):
        if iteration in save_at:
            save(iteration)
        if iteration < args.steps:
            train_megatron.train_step(args, chunks, optimizer, data)
    dist.barrier()
    dist.destroy_process_group()  # then a normal exit: it stops the process dist-checkpointing's writer started


if __name__ == "__main__":
    main()
