"""A DeepSpeed (ZeRO 0-3) job on CPU (gloo) monitored by trainmon from a JSON config.

  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 --master_addr=127.0.0.1 \
      --master_port=29521 scripts/train_deepspeed.py --stage 2 --config configs/deepspeed.json
  # --bf16 for bf16 weights with fp32 master weights; DeepSpeed's launcher works too.
  # --config none trains unmonitored; --timings PATH writes step times (benchmarks/frameworks.py).

The optimizer is a client torch.optim.AdamW (DeepSpeed's own Adam would compile a C++ op first).
Output: $MONITOR_OUTPUT_DIR (default ./monitor_output)/<run>/rank_<R>/.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn

from step_timer import StepTimer
from trainmon import TrainerMon


class TinyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, seq: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(hidden, 4, 4 * hidden, dropout=0.0, batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1), persistent=False)

    def forward(self, tokens, labels):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h, src_mask=self.mask.to(h.dtype))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "deepspeed.json"),
                        help='trainmon config; "none" trains without a monitor')
    parser.add_argument("--timings", metavar="PATH", help="write step times and module calls to PATH.rank<R>.json")
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.hidden, args.layers, args.seq)
    zero = {"stage": args.stage}
    if args.stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # a tiny model is otherwise not partitioned at all
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={"train_micro_batch_size_per_gpu": args.mbs, "gradient_accumulation_steps": args.gas,
                "gradient_clipping": 1.0, "zero_optimization": zero, "bf16": {"enabled": args.bf16},
                "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 6})
    monitor = None
    if args.config != "none":
        monitor = TrainerMon(args.config)
        monitor.set_monitor(engine, optimizer=optimizer, grad_acc_steps=args.gas)

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)  # each data-parallel rank its own data

    def train_step():
        for _ in range(args.gas):
            start = torch.randint(0, args.vocab, (args.mbs, 1), generator=gen)
            tokens = (start + torch.arange(args.seq + 1)) % args.vocab  # learnable: next token = token + 1
            loss = engine(tokens[:, :-1].to(engine.device), tokens[:, 1:].to(engine.device))
            engine.backward(loss)
            engine.step()
        return loss

    timer = StepTimer(args.timings, rank) if args.timings else None
    for step in range(args.steps):
        loss = train_step()
        if timer:
            timer.step_done()
        print(f"[rank{rank}] step {step} loss {loss.item():.4f}", flush=True)
    if timer:
        with timer.count_calls(list(engine.modules())):
            train_step()
        timer.write()
    if monitor:
        monitor.stop()
        print(f"[rank{rank}] monitor output in {monitor.output_dir}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
