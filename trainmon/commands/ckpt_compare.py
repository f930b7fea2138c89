"""`trainmon ckpt-compare A B`: per parameter L2 distance, cosine, max |diff|, non-finite mismatches, element
count and shape of two checkpoints (Megatron legacy or dist-checkpointing, DeepSpeed, torch.save,
safetensors), TP/PP shards merged.

Exit status: 0 the checkpoints agree (every parameter in both and identical), 1 they differ, 2 bad input.
"""
from __future__ import annotations

import argparse
import json

from trainmon.commands.arguments import EXIT_CLEAN, EXIT_FOUND, add_json
from trainmon.read.errors import InputError

SHOWN = 10


def register(subparsers) -> None:
    parser = subparsers.add_parser("ckpt-compare", help="compare two checkpoints parameter by parameter",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="checkpoint A: a directory or file")
    parser.add_argument("b", help="checkpoint B")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the full result as JSON to FILE")
    parser.add_argument("--map", metavar="FILE",
                        help='JSON {"<regex on B\'s names>": "<name in A>"}: renames B\'s parameters in A\'s terms')
    add_json(parser, help="print the full result as one JSON object instead of the table")
    parser.set_defaults(handler=run)


def _figure(value) -> str:
    return "-" if value is None else f"{value:.6g}"


def _shown(p: dict) -> tuple:
    """(l2, cosine, max|diff|) as the table shows them: NaN where elements are finite on one side only, since
    the figures, taken over the elements finite in both, would hide that difference."""
    if p.get("nonfinite_mismatch"):
        return (float("nan"),) * 3
    return p.get("l2"), p.get("cosine"), p.get("max_abs_diff")


def run(args: argparse.Namespace) -> int:
    from trainmon.ckpt.compare import compare_checkpoints  # imports torch
    from trainmon.ckpt.names import load_mapping

    rename = load_mapping(args.map) if args.map else None
    result = compare_checkpoints(args.a, args.b, rename)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
        except OSError as err:
            raise InputError.at(args.output, f"cannot write ({err.strerror or err})") from None
    s = result["summary"]
    agree = s["differ"] == 0 and s["only_in_a"] == 0 and s["only_in_b"] == 0
    if args.json:
        print(json.dumps(result, indent=1))
        return EXIT_CLEAN if agree else EXIT_FOUND
    print(f"A: {result['a']['read']} ({result['a']['format']})\nB: {result['b']['read']} ({result['b']['format']})")
    print(f"{s['compared']} parameters compared: {s['identical']} identical, {s['differ']} differ; "
          f"{s['only_in_a']} only in A, {s['only_in_b']} only in B")
    # non-finite mismatches first: the figures cannot rank them
    differing = sorted(((n, p) for n, p in result["parameters"].items() if not p["identical"]),
                       key=lambda item: (not item[1].get("nonfinite_mismatch"), -(item[1].get("l2") or 0.0)))
    if differing:
        print(f"\n{'parameter':<60}{'l2':>12}{'cosine':>12}{'max|diff|':>12}{'nonfinite≠':>12}  shape")
        for name, p in differing[:SHOWN]:
            shape = str(p["shape_a"]) if p["shape_a"] == p["shape_b"] else f"{p['shape_a']} vs {p['shape_b']}"
            l2, cosine, max_diff = _shown(p)
            mismatch = p.get("nonfinite_mismatch")
            print(f"{name:<60}{_figure(l2):>12}{_figure(cosine):>12}{_figure(max_diff):>12}"
                  f"{'-' if mismatch is None else mismatch:>12}  {shape}")
        if len(differing) > SHOWN:
            print(f"... {len(differing) - SHOWN} more in the JSON output")
        if any(p.get("nonfinite_mismatch") for _, p in differing):
            print("nonfinite≠: elements finite in one checkpoint and NaN/Inf in the other; their l2, cosine and "
                  "max|diff| are shown as nan (the JSON holds those figures over the elements finite in both)")
    for side in ("a", "b"):
        names = result[f"only_in_{side}"]
        if names:
            print(f"only in {side.upper()}: {', '.join(names[:SHOWN])}{' ...' if len(names) > SHOWN else ''}")
    return EXIT_CLEAN if agree else EXIT_FOUND
