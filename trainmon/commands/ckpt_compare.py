"""`trainmon ckpt-compare A B`: per parameter L2 distance, cosine, max |diff|, element count and shape of two
checkpoints (Megatron legacy or dist-checkpointing, DeepSpeed, torch.save, safetensors), TP/PP shards merged."""
from __future__ import annotations

import argparse
import json

from trainmon.ckpt.compare import compare_checkpoints
from trainmon.ckpt.names import load_mapping
from trainmon.read.errors import InputError

SHOWN = 10


def register(subparsers) -> None:
    parser = subparsers.add_parser("ckpt-compare", help="compare two checkpoints parameter by parameter",
                                   description=__doc__)
    parser.add_argument("a", help="checkpoint A: a directory or file")
    parser.add_argument("b", help="checkpoint B")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the full result as JSON to FILE")
    parser.add_argument("--map", metavar="FILE",
                        help='JSON {"<regex on B\'s names>": "<name in A>"}: renames B\'s parameters in A\'s terms')
    parser.set_defaults(handler=run)


def _figure(value) -> str:
    return "-" if value is None else f"{value:.6g}"


def run(args: argparse.Namespace) -> int:
    rename = load_mapping(args.map) if args.map else None
    result = compare_checkpoints(args.a, args.b, rename)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
        except OSError as err:
            raise InputError.at(args.output, f"cannot write ({err.strerror or err})") from None
    s = result["summary"]
    print(f"A: {result['a']['read']} ({result['a']['format']})\nB: {result['b']['read']} ({result['b']['format']})")
    print(f"{s['compared']} parameters compared: {s['identical']} identical, {s['differ']} differ; "
          f"{s['only_in_a']} only in A, {s['only_in_b']} only in B")
    differing = sorted(((n, p) for n, p in result["parameters"].items() if not p["identical"]),
                       key=lambda item: -(item[1].get("l2") or 0.0))
    if differing:
        print(f"\n{'parameter':<60}{'l2':>12}{'cosine':>12}{'max|diff|':>12}  shape")
        for name, p in differing[:SHOWN]:
            shape = str(p["shape_a"]) if p["shape_a"] == p["shape_b"] else f"{p['shape_a']} vs {p['shape_b']}"
            print(f"{name:<60}{_figure(p.get('l2')):>12}{_figure(p.get('cosine')):>12}"
                  f"{_figure(p.get('max_abs_diff')):>12}  {shape}")
        if len(differing) > SHOWN:
            print(f"... {len(differing) - SHOWN} more in the JSON output")
    for side in ("a", "b"):
        names = result[f"only_in_{side}"]
        if names:
            print(f"only in {side.upper()}: {', '.join(names[:SHOWN])}{' ...' if len(names) > SHOWN else ''}")
    return 0
