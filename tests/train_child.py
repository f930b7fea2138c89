"""A training job for the crash tests: trains until killed (or --steps), printing each finished step.

    python tests/train_child.py CONFIG [--steps N] [--no-stop] [--fsize BYTES]
"""
import argparse
import os
import resource
import signal
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from training import batches, make_model  # noqa: E402
from trainmon import TrainerMon  # noqa: E402
from trainmon.demo import lm_loss  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("config")
parser.add_argument("--steps", type=int, default=100_000)
parser.add_argument("--no-stop", action="store_true", help="exit without monitor.stop() (atexit must save)")
parser.add_argument("--fsize", type=int, help="RLIMIT_FSIZE: no file may grow beyond this (a full disk)")
parser.add_argument("--graceful", action="store_true", help="own SIGTERM handler: finish the step, then stop")
args = parser.parse_args()
stop_requested = []
if args.graceful:
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_requested.append(signum))
if args.fsize:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes beyond the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize, args.fsize))
torch.set_num_threads(1)
model = make_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
monitor = TrainerMon(args.config)
monitor.set_monitor(model, optimizer=optimizer)
print("output", monitor.output_dir, flush=True)
data = batches()
for step in range(args.steps):
    if stop_requested:
        print("graceful stop", flush=True)
        break
    tokens, labels = next(data)
    loss = lm_loss(model, tokens, labels)
    loss.backward()
    monitor.log_scalar("loss", loss.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print("step", step, flush=True)
if not args.no_stop:
    monitor.stop()
print("done", flush=True)
