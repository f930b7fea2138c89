"""Known collectives and p2p ops, sync and async, inside a monitored training step on 2 ranks.

  torchrun --nproc_per_node=2 job_comm.py --out DIR
Rank r contributes tensors filled with r + 1, so every recorded figure is known in advance.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common import TinyLM, batches, finish, write_config
from trainmon import TrainerMon
from trainmon.core.collective_ops import ALL_OPS

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--cc", default="{}", help="more cc_distribution keys, as JSON")
args = parser.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, peer = dist.get_rank(), 1 - dist.get_rank()
pair = dist.new_group([0, 1])  # the same ranks as the world, another group (its own sequence numbers)
originals = {op: (getattr(dist, op), getattr(c10d, op)) for op in ALL_OPS + ("_coalescing_manager",)}
original_wait = c10d.Work.wait

torch.manual_seed(0)
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
monitor = TrainerMon(write_config(os.path.join(args.out, f"config.rank{rank}.json"), wg_distribution=False,
                                  mv_distribution=False, param_distribution=False,
                                  cc_distribution={"enable": True, "cc_pre_hook": True, **json.loads(args.cc)}))
monitor.set_monitor(model, optimizer=optimizer)


def unpatched() -> bool:
    return (all(getattr(dist, op) is orig[0] and getattr(c10d, op) is orig[1] for op, orig in originals.items())
            and c10d.Work.wait is original_wait)


patched = not unpatched() and all(getattr(dist, op) is not orig[0] for op, orig in originals.items())


def mine(value=None, n=4):
    return torch.full((n,), float(rank + 1 if value is None else value))


data = batches(0)
for step in range(2):
    x, y = next(data)
    model(x, y).backward()
    dist.all_reduce(mine())                                   # all_reduce @world #0: in r+1, out 3
    if step == 0:
        dist.all_reduce(mine(), group=pair)                   # all_reduce @pair #0 (codeline-target)
        work = dist.all_reduce(mine(), async_op=True)         # all_reduce @world #1, output at wait()
        work.wait()
        gathered = torch.empty(8)
        dist.all_gather_into_tensor(gathered, mine())         # out: [1]*4 + [2]*4
        scattered = torch.empty(2)
        dist.reduce_scatter_tensor(scattered, mine(n=4))      # out: 3, 3
        dist.broadcast(mine(), src=1)                         # out: 2 everywhere
        parts = [torch.empty(4), torch.empty(4)]
        dist.all_gather(parts, mine())                        # out_0: 1, out_1: 2
        if rank == 0:                                         # p2p 0→1, sync then async
            dist.send(mine(7.0), dst=1)
            dist.isend(mine(8.0), dst=1).wait()
        else:
            dist.recv(torch.empty(4), src=0)
            dist.irecv(torch.empty(4), src=0).wait()
        inbox = torch.empty(4)                                # both directions in one batch
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine(10.0 + rank), peer),
                                             dist.P2POp(dist.irecv, inbox, peer)]):
            work.wait()
        # queued by the coalescing manager and run at its exit: outputs recorded then, or at the Work's wait()
        with c10d._coalescing_manager():
            dist.reduce_scatter_tensor(torch.zeros(2), mine())    # @world #6, #7: out 3, 3
            dist.reduce_scatter_tensor(torch.zeros(2), mine())
        gathered = torch.zeros(8)
        with c10d._coalescing_manager(async_ops=True) as manager:
            dist.all_gather_into_tensor(gathered, mine(), async_op=True)  # @world #8
        manager.wait()
        dist.reduce_scatter_single(torch.zeros(2), mine())        # @world #9 (FSDP2's spelling)
        dist.all_gather_single(torch.zeros(8), mine())            # @world #10
        late = dist.all_reduce(mine(), async_op=True)             # @world #11, waited for in the next step
    optimizer.step()
    optimizer.zero_grad()
    if step == 0:
        late.wait()                                           # its output is not recorded
    if step == 0:
        restored_after_step0 = unpatched()

monitor.stop()
restored = unpatched()
dist.all_reduce(mine())  # after stop(): not recorded
with open(os.path.join(args.out, f"patches.rank{rank}.json"), "w") as f:
    json.dump({"patched": patched, "restored_after_step0": restored_after_step0, "restored": restored}, f)
finish(monitor)
