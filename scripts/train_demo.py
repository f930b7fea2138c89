"""Trains a small GPT-style model with trainmon enabled from configs/demo.json.

    python scripts/train_demo.py [--config configs/demo.json] [--steps 300]
"""
import os
import sys

from trainmon.commands import demo

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--config" not in argv:
        argv = ["--config", os.path.join(os.path.dirname(__file__), "..", "configs", "demo.json")] + argv
    sys.exit(demo.main(argv))
