"""What a compiled forward saves for its backward at a GPU model's size, per tier, without a GPU.

AOTAutograd's partitioner decides which tensors a compiled forward saves for the backward; trainmon's op in the
graph (`in_graph`) can change that decision, and the GPU runs measured it as peak memory (`gpu.py`: saved MB).
Here the same decision is taken on fake tensors, so no memory is allocated and nothing is computed: TinyGPT at
the size of `gpu.py` (bf16, hidden 2048, seq 1024, batch 8; 2 layers, the figure grows by layer), trainmon
attached with a tier's config, its loss traced by AOTAutograd with inductor's decompositions and the min-cut
partitioner. The figure is the bytes of the forward graph's outputs beyond the loss: what it saves.

The hooks run as they do inside a `torch.compile`d region (the trace stands for Dynamo's): every hook of every
module becomes the op. `--sdpa flash` traces the attention a CUDA bf16 run dispatches to. `--keep-setting`
leaves the partitioner's `ban_recompute_used_far_apart` on where trainmon turns it off (the memory before that).

    python benchmarks/compiled_saved.py
    python benchmarks/compiled_saved.py --keep-setting
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from gpu import GPU_TIERS, add_model_arguments
from overhead import attach_monitor, tier_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def saved_bytes(args, tier: str) -> dict:
    """Traces one forward and backward of the model with `tier` attached (child side)."""
    import torch
    import torch.nn.functional as F
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from trainmon.demo import TinyGPT
    from trainmon.hooks import in_graph

    if args.keep_setting:
        in_graph._partition_as_unmonitored = lambda: None
    if args.sdpa == "flash":
        F.scaled_dot_product_attention = lambda q, k, v, is_causal: (
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal)[0])
    dtype = getattr(torch, args.dtype)
    with torch.device("meta"):
        model = TinyGPT(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                        seq=args.seq).to(dtype=dtype)
    out_dir = tempfile.mkdtemp(prefix="trainmon_saved_")
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    monitor = attach_monitor(tier_config(tier, ["db"], tiers=GPU_TIERS), out_dir, model,
                             torch.optim.AdamW(model.parameters()))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = {name: FakeTensor(mode, p.detach(), torch.device("cpu")).requires_grad_()
              for name, p in model.named_parameters()}
    tokens = FakeTensor(mode, torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta"), torch.device("cpu"))
    found = {}

    def forward_compiler(graph_module, _inputs):
        outputs = next(iter(graph_module.graph.find_nodes(op="output"))).args[0]
        values = [n.meta.get("val") for n in outputs[1:]]        # the loss first, then what is saved
        found["bytes"] = sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))
        found["tensors"] = sum(isinstance(v, torch.Tensor) for v in values)
        return graph_module

    def loss(params, tokens):
        logits = torch.func.functional_call(model, params, (tokens,))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))

    traced = aot_function(loss, fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm,
                          partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    compiling = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True      # the hooks trace themselves, as under Dynamo
    try:
        with mode:
            traced(params, tokens)
    finally:
        torch.compiler.is_compiling = compiling
    if monitor is not None:
        monitor.stop()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiers", default="none,sentinel,full")
    add_model_arguments(parser, layers=2, vocab=1024)
    parser.add_argument("--sdpa", choices=("default", "flash"), default="default")
    parser.add_argument("--keep-setting", action="store_true",
                        help="leave the partitioner's setting as it is where trainmon turns it off")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(saved_bytes(args, args.child)))
        return 0
    print(f"TinyGPT {args.dtype}, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, "
          f"SDPA {args.sdpa}{', the setting kept' if args.keep_setting else ''}: saved for backward by the "
          "compiled forward\n")
    print("| tier | saved MB | per layer | × none | tensors |")
    print("| --- | --- | --- | --- | --- |")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    none = None
    for tier in args.tiers.split(","):
        # each tier in a process of its own: trainmon's hooks and the patches above stay out of the next one
        done = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", tier], env=env,
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{tier} failed:\n{(done.stdout + done.stderr)[-3000:]}")
        found = json.loads(done.stdout.strip().splitlines()[-1])
        megabytes = found["bytes"] / 2**20
        none = megabytes if tier == "none" else none
        ratio = f"{megabytes / none:.3f}" if none else "-"
        print(f"| {tier} | {megabytes:,.1f} | {megabytes / args.layers:,.1f} | {ratio} | {found['tensors']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
