"""`trainmon demo`: train a small GPT-style model with monitoring and show the output (trainmon.demo, which
imports torch only when the command runs)."""
from __future__ import annotations

import argparse
from typing import Optional

from trainmon.commands.arguments import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (also those of scripts/train_demo.py)."""
    parser.add_argument("--config", metavar="FILE",
                        help="a trainmon JSON config (default: the embedded demo config); checked before training")
    parser.add_argument("--steps", type=positive_int, default=300, metavar="N",
                        help="how many training steps to run (default 300)")
    parser.add_argument("--grad-acc-steps", type=positive_int, default=1, metavar="N",
                        help="micro-batches accumulated per step (default 1)")
    parser.add_argument("--inject", choices=["nan", "instability"],
                        help="nan: put an Inf into a layer's output half-way through, and show the alert and "
                             "nan-analyze naming it; instability: ramp the learning rate x50 over 100 steps from "
                             "half-way, and show the early warning (AnomalyPrecursor) before the loss spike")


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="train a small GPT-style model with monitoring and show the output",
                                   description=__doc__)
    add_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.config is not None:
        from trainmon.config.settings import load_config
        load_config(args.config)  # a bad or missing config is a ConfigError (exit 2) before the model is built
    from trainmon import demo
    return demo.run(args)


def main(argv: Optional[list[str]] = None) -> int:
    """scripts/train_demo.py: the demo's options, without the rest of the command line."""
    parser = argparse.ArgumentParser(prog="train_demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
