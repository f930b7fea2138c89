"""The bytes each tier's statistics read a step at a GPU-sized model, and the time those reads take at a device's
memory bandwidth: the least a tier can add to a step there, whatever its kernels and host work, while its reads
run in turn with the step's own kernels (on the training's stream, as they do).

Every read is counted where it happens: the statistic engine's calls (`stats.tensor_records`, the distinct views
of each call), the NaN sentinel's probes (`sentinel.probe`, `sentinel.norm_probes`) and the reads of CPU tensors
in their hooks (`stats_cpu.RecordsOnArrival.take`). The model is gpu.py's TinyGPT, trained on the CPU in its dtype
at two short sequence lengths (batch 1); a step's bytes are a fixed part (weights, grads, optimizer state) plus a
part in proportion to its tokens (activations and their grads: TinyGPT has no tensor of sequence x sequence), fitted
from the two and taken at `--batch` x `--seq` tokens.

Columns: the fixed part and the part with the tokens, GB a step; the same total split by reader (the engine, the
sentinel); the floor, that total at `--bandwidth-tbs`, in ms and as a ratio against `--none-step-ms`.

    python benchmarks/floor.py                                         # TinyGPT bf16, 12 layers, hidden 2048
    python benchmarks/floor.py --bandwidth-tbs 3.35 --none-step-ms 78.7   # the floor as a ratio against a step
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from gpu import GPU_TIERS, MODEL_SHAPE, add_model_arguments
from overhead import attach_monitor, tier_config

FAMILIES = ("engine", "sentinel")


def count_reads(tier: str, args, seq: int) -> dict:
    """Bytes read a step by the engine and by the sentinel, in the second of two steps (the child side)."""
    import torch

    from trainmon.demo import TinyGPT, lm_loss, synthetic_batch
    from trainmon.engine import stats, stats_cpu
    from trainmon.hooks import sentinel

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    dtype = getattr(torch, args.dtype)
    model = TinyGPT(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                    seq=args.seq).to(dtype)       # the target's position table: weights the same at both lengths
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out = tempfile.mkdtemp(prefix="trainmon_floor_")
    os.environ["MONITOR_OUTPUT_DIR"] = out
    counted = {family: 0 for family in FAMILIES}
    counting = [False]

    def views(tensors) -> int:
        """Bytes of the distinct views among `tensors` (the engine reads each once per call)."""
        seen = {(t.data_ptr(), t.dtype, t.shape, t.stride()): t.numel() * t.element_size()
                for t in tensors if t is not None}
        return sum(seen.values())

    def wrap(owner, name: str, family: str, tensors_of, read=lambda result: True):
        original = getattr(owner, name)

        def counted_call(*a, **k):
            result = original(*a, **k)
            if counting[0] and read(result):
                counted[family] += views(tensors_of(*a))
            return result
        setattr(owner, name, counted_call)
    wrap(stats, "tensor_records", "engine", lambda tensors, *_: tensors)
    # a tensor `take` refuses (-1) is held and read by a later `tensor_records`
    wrap(stats_cpu.RecordsOnArrival, "take", "engine", lambda _self, t: [t], read=lambda row: row >= 0)
    wrap(sentinel, "probe", "sentinel", lambda t: [t])
    wrap(sentinel, "norm_probes", "sentinel", lambda tensors: tensors)
    monitor = attach_monitor(tier_config(tier, ["db"], tiers=GPU_TIERS), out, model, optimizer)
    tokens, labels = synthetic_batch(torch.Generator().manual_seed(1), 1, seq, args.vocab)
    for step in range(3):
        counting[0] = step == 2
        lm_loss(model, tokens, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    monitor.stop()
    return counted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiers", default="sentinel,wg,wg+xy,full,all", help="tiers of gpu.py, comma-separated")
    add_model_arguments(ap)
    ap.add_argument("--fit-seqs", default="16,32", help="the two sequence lengths the CPU runs (batch 1)")
    ap.add_argument("--bandwidth-tbs", type=float, default=3.35, help="device memory bandwidth, TB/s (H100 SXM)")
    ap.add_argument("--none-step-ms", type=float, default=78.7,
                    help="the unmonitored step on that device (the fifth GPU run's eager `none`)")
    ap.add_argument("--child", nargs=2, metavar=("TIER", "SEQ"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(count_reads(args.child[0], args, int(args.child[1]))))
        return 0
    short, long = (int(s) for s in args.fit_seqs.split(","))
    tokens = args.batch * args.seq
    print(f"TinyGPT {args.dtype}, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {args.batch} x "
          f"{args.seq} tokens; reads fitted from batch 1 x {short} and x {long}; {args.bandwidth_tbs} TB/s, "
          f"`none` {args.none_step_ms} ms a step")
    print(f"{'tier':9} {'fixed GB':>9} {'tokens GB':>10} {'engine GB':>10} {'sentinel GB':>12} {'floor ms':>9} "
          f"{'floor x':>8}")
    shape = [f"--{name}={getattr(args, name)}" for name in MODEL_SHAPE if name != "batch"]   # the child's batch is 1
    for tier in args.tiers.split(","):
        runs = []
        for seq in (short, long):
            child = subprocess.run([sys.executable, __file__, *shape, "--child", tier, str(seq)], check=True,
                                   capture_output=True, text=True)
            runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
        at = {}
        fixed = with_tokens = 0.0
        for family in FAMILIES:
            slope = (runs[1][family] - runs[0][family]) / (long - short)
            base = runs[0][family] - slope * short
            fixed, with_tokens = fixed + base, with_tokens + slope * tokens
            at[family] = base + slope * tokens
        total = sum(at.values())
        floor_ms = total / (args.bandwidth_tbs * 1e12) * 1e3
        print(f"{tier:9} {fixed / 1e9:9.2f} {with_tokens / 1e9:10.2f} {at['engine'] / 1e9:10.2f} "
              f"{at['sentinel'] / 1e9:12.2f} {floor_ms:9.2f} {(args.none_step_ms + floor_ms) / args.none_step_ms:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
