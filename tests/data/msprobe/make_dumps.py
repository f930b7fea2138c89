"""Writes the msprobe dumps under this directory with msprobe itself (not run by the tests).

    pip install --no-deps mindstudio-probe==26.2.0 && pip install matplotlib openpyxl pytz
    python tests/data/msprobe/make_dumps.py /tmp/msprobe_out
    # then keep only the dump.json files (stack.json holds this machine's paths):
    cd /tmp/msprobe_out && find . -name dump.json -exec cp --parents {} <repo>/tests/data/msprobe \;

Two 2-process gloo jobs on CPU, two steps each, msprobe task "statistics" at level "mix" (modules and
APIs, distributed APIs included). At step 1 one rank's `Inject` module divides by zero:
- all_reduce/: rank 1 is faulty; the model all-reduces its hidden activations (tensor-parallel style), so
  the NaN/Inf reaches rank 0 through `Distributed.all_reduce.0`; the grads are all-reduced afterwards.
- p2p/: a two-stage pipeline; rank 0 (stage 0) is faulty and sends its output with batch_isend_irecv,
  rank 1 sends the input grads back with send/recv on an explicit process group.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Inject(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("div", torch.tensor(1.0))

    def forward(self, x):
        return x / self.div


class TensorParallelNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 4)
        self.act = torch.nn.ReLU()
        self.inject = Inject()
        self.fc2 = torch.nn.Linear(4, 2)

    def forward(self, x):
        h = self.inject(self.act(self.fc1(x)))
        dist.all_reduce(h)
        return self.fc2(h)


def all_reduce_job(rank, debugger):
    torch.manual_seed(0)
    model = TensorParallelNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        if step == 1 and rank == 1:
            model.inject.div.fill_(0.0)
        debugger.start(model)
        model(torch.randn(3, 4)).sum().backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        optimizer.step()
        optimizer.zero_grad()
        debugger.stop()
        debugger.step()


def p2p_job(rank, debugger):
    group = dist.new_group([0, 1])
    torch.manual_seed(rank)
    stage = (torch.nn.Sequential(torch.nn.Linear(4, 4), Inject()) if rank == 0
             else torch.nn.Sequential(torch.nn.Linear(4, 2)))
    for step in range(2):
        if step == 1 and rank == 0:
            stage[1].div.fill_(0.0)
        debugger.start(stage)
        if rank == 0:
            h = stage(torch.randn(3, 4))
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, h.detach(), 1, group=group)]):
                req.wait()
            grad = torch.zeros(3, 4)
            dist.recv(grad, src=1, group=group)
            h.backward(grad)
        else:
            received = torch.zeros(3, 4)
            for req in dist.batch_isend_irecv([dist.P2POp(dist.irecv, received, 0, group=group)]):
                req.wait()
            received.requires_grad_()
            stage(received).sum().backward()
            dist.send(received.grad, dst=0, group=group)
        debugger.stop()
        debugger.step()


def worker(rank, job, out, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from msprobe.pytorch import PrecisionDebugger
    debugger = PrecisionDebugger(config_path=os.path.join(out, "config.json"))
    {"all_reduce": all_reduce_job, "p2p": p2p_job}[job](rank, debugger)
    dist.destroy_process_group()


def main(root):
    for port, job in enumerate(("all_reduce", "p2p"), 29541):
        out = os.path.join(root, job)
        os.makedirs(out, exist_ok=True)
        config = {"task": "statistics", "dump_path": out, "rank": [], "step": [], "level": "mix",
                  "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"}}
        with open(os.path.join(out, "config.json"), "w") as fh:
            json.dump(config, fh)
        mp.spawn(worker, args=(job, out, port), nprocs=2)


if __name__ == "__main__":
    main(sys.argv[1])
