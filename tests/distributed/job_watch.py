"""DDP training of a tiny LM writing only `db`, with `trainmon watch` spawned by global rank 0 (`watch` key).

  torchrun --nproc_per_node=2 job_watch.py --out DIR --inject RANK:STEP [--steps N] [--step-seconds S]

Rank 0 reads the daemon's alerts file after every step and writes `alert_seen.json` (the step at which
an alert was first there, and the latest alert it read), so the test knows the alert came while the job
still ran;
it also writes the daemon's pid to `watch_pid`.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist

from common import TinyLM, batches, finish, inject_inf, write_config
from trainmon import TrainerMon

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--inject", required=True, metavar="RANK:STEP")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--step-seconds", type=float, default=0.4, help="a step lasts at least this long")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = TinyLM()
step = 0
inject_inf(model.blocks[0], args.inject, rank, lambda: step)
model = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
config = write_config(os.path.join(args.out, f"config.rank{rank}.json"), format="db", xy_distribution=True,
                      sentinel=True, ops=["norm", "min", "max", "nans", "infs"],
                      watch={"enable": True, "interval": 0.5, "heatmap_every": 15, "detail": [r"^head\."]})
monitor = TrainerMon(config)
monitor.set_monitor(model, optimizer=optimizer)
if rank == 0:
    with open(os.path.join(args.out, "watch_pid"), "w") as f:
        f.write(str(monitor.watch_process.pid))
alerts = monitor.output_dir.parent / "watch" / "alerts.jsonl"
seen = None
data = batches(100 + rank)
for step in range(args.steps):
    started = time.monotonic()
    x, y = next(data)
    loss = model(x, y)
    loss.backward()
    monitor.log_scalar("loss", loss.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if rank == 0 and alerts.exists() and alerts.stat().st_size:
        seen = seen or {"first_seen_at_step": step}
        seen["latest"] = json.loads(alerts.read_text().splitlines()[-1])
        seen["latest_at_step"] = step
        with open(os.path.join(args.out, "alert_seen.json"), "w") as f:
            json.dump(seen, f)
    time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))
finish(monitor)
