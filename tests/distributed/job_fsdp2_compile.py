"""FSDP2 with each block compiled on its own, torchtitan-style, under TrainerMon with every tier on.

  torchrun --nproc_per_node=2 job_fsdp2_compile.py --compile none|wrap|in_place --out DIR
           [--backend aot_eager|inductor] [--baseline] [--inject RANK:STEP:MICRO]

Each block is compiled (`wrap`: `torch.compile(block)` put back in its place, as torchtitan does; `in_place`:
`block.compile()`) and then `fully_shard`-ed, then the root; `none` is the same job in eager mode. With
`--baseline` the same model is first trained unmonitored, so a test can tell graph breaks and graphs of
trainmon's from those of torch's. Writes `compile.rank<R>.json`: per run, its losses, graph breaks and graphs.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common import finish, write_config
from trainmon import TrainerMon
from trainmon.demo import TinyGPT, lm_loss, synthetic_batch

LAYERS, MICRO_BATCHES, STEPS = 4, 2, 3
OPS = ["norm", "min", "max", "nans", "infs", "zeros", "mean"]
FAULTY = "mlp.0"  # the module of block 1 that `--inject` makes return an Inf

parser = argparse.ArgumentParser()
parser.add_argument("--compile", choices=["none", "wrap", "in_place"], required=True)
parser.add_argument("--backend", default="aot_eager")
parser.add_argument("--out", required=True)
parser.add_argument("--baseline", action="store_true", help="train unmonitored first")
parser.add_argument("--inject", metavar="RANK:STEP:MICRO",
                    help=f"an Inf in the weight of layers.1.{FAULTY} as its forward sees it, on that rank only")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))


def build() -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, hidden=32, layers=LAYERS, heads=4, seq=16)
    for i, block in enumerate(model.layers):
        if args.compile == "wrap":
            block = torch.compile(block, backend=args.backend, fullgraph=True)
            model.layers.register_module(str(i), block)
        elif args.compile == "in_place":
            block.compile(backend=args.backend, fullgraph=True)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def inject(model: TinyGPT, spec: str, position: dict) -> None:
    """At (step, micro) on the rank of `spec`, after FSDP has all-gathered block 1's parameters for its forward,
    writes +Inf into this rank's unsharded copy of one weight: that forward's output of the module is the
    run's first non-finite tensor, and the other rank's forward stays finite (the shards are untouched)."""
    bad_rank, bad_step, bad_micro = (int(v) for v in spec.split(":"))
    block = model.layers[1]
    faulty = getattr(block, "_orig_mod", block).get_submodule(FAULTY)

    @torch._dynamo.disable  # the test's own fault, not part of the graph under test
    def fault(module, inputs):
        if (rank, position["step"], position["micro"]) == (bad_rank, bad_step, bad_micro):
            with torch.no_grad():  # the unsharded parameter FSDP put in place for this forward
                faulty.weight.view(-1)[0] = float("inf")

    block.register_forward_pre_hook(fault)


def train(model, optimizer, position: dict) -> list[float]:
    data, losses = _batches(), []
    for position["step"] in range(STEPS):
        for position["micro"] in range(MICRO_BATCHES):
            tokens, labels = next(data)
            loss = lm_loss(model, tokens, labels) / MICRO_BATCHES
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _batches():
    gen = torch.Generator().manual_seed(100 + rank)  # each data-parallel rank its own data
    while True:
        yield synthetic_batch(gen, 4, 16, 64)


def run(monitored: bool) -> dict:
    torch._dynamo.reset()
    counters.clear()
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    position = {"step": 0, "micro": 0}
    if args.inject:
        inject(model, args.inject, position)
    monitor = None
    if monitored:
        config = write_config(os.path.join(args.out, f"config.rank{rank}.json"), sentinel=True, xy_distribution=True,
                              all_xy=True, targets={}, cc_distribution={"enable": True}, format=["csv", "db"],
                              ops=OPS, alert={"rules": [{"rule_name": "AnomalyNan"}]})
        monitor = TrainerMon(config)
        monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=MICRO_BATCHES)
    losses = train(model, optimizer, position)
    figures = {"losses": losses, "graph_breaks": sum(counters["graph_break"].values()),
               "graphs": counters["stats"]["unique_graphs"],
               "orig_mod_params": sum("_orig_mod" in name for name, _ in model.named_parameters())}
    return figures, monitor


result = {}
if args.baseline:
    result["unmonitored"], _ = run(monitored=False)
result["monitored"], monitor = run(monitored=True)
with open(os.path.join(args.out, f"compile.rank{rank}.json"), "w") as f:
    json.dump(result, f)
finish(monitor)
