"""The structure view at scale: a 100-layer model, and a run of 1,000 ranks, served by TensorBoard.

    python benchmarks/structure_view_scale.py [--layers 100] [--ranks 1000] [--work DIR]

Trains a `--layers`-layer TinyGPT for 2 steps with a NaN injected in the last layer at step 1 (every
statistic family, module_struct.json, the database), then makes a second run of `--ranks` ranks whose rank
directories hold copies of a small run's database. Starts `tensorboard --logdir` with the plugin, and
prints the time of each plugin route, the size of the tree it sends, and, when Chromium and websocket-client
are there, the time until the page shows the first NaN with its node revealed, and until it shows rank
`--ranks - 1` after the rank is typed in.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

from cdp import Browser, free_port, wait_for_http  # noqa: E402
from trainmon import TrainerMon  # noqa: E402
from trainmon.demo import TinyGPT, lm_loss, synthetic_batch  # noqa: E402

CONFIG = dict(targets={}, all_xy=True, xy_distribution=True, wg_distribution=True, param_distribution=True,
              mv_distribution=True, sentinel=True, print_struct=True, format=["db"],
              ops=["norm", "min", "max", "mean", "nans", "infs"])


def train(out: Path, config: Path, layers: int, nan_layer: int) -> Path:
    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, hidden=16, layers=layers, heads=2, seq=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = {"now": 0}
    model.layers[nan_layer].mlp[0].register_forward_hook(
        lambda m, args, out: out * float("nan") if step["now"] == 1 else None)
    monitor = TrainerMon(str(config)).set_monitor(model, optimizer=optimizer)
    gen = torch.Generator().manual_seed(1)
    for s in range(2):
        step["now"] = s
        tokens, labels = synthetic_batch(gen, 2, 8, 64)
        lm_loss(model, tokens, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    monitor.stop()
    return next(out.iterdir())


def many_ranks(source: Path, target: Path, ranks: int) -> None:
    """A run of `ranks` ranks, each a copy of `source`'s rank 0 (its run.json saying its rank)."""
    meta = json.loads((source / "rank_0" / "run.json").read_text())
    for rank in range(ranks):
        rank_dir = target / f"rank_{rank}"
        rank_dir.mkdir(parents=True)
        os.link(source / "rank_0" / "monitor.db", rank_dir / "monitor.db")
        (rank_dir / "run.json").write_text(json.dumps({**meta, "rank": rank, "world_size": ranks}))


def timed_get(url: str) -> tuple[float, int]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as response:
        body = response.read()
    return time.perf_counter() - start, len(body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--work", help="directory for the runs (default: a temporary one)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="structure-scale-"))
    config = work / "config.json"
    work.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(CONFIG))
    logdir = work / "monitor_output"
    start = time.perf_counter()
    deep = train(work / "deep_layers", config, args.layers, args.layers - 1)
    shutil.move(str(deep), str(logdir / "deep_layers"))
    small = train(work / "small", config, 2, 1)
    many_ranks(small, logdir / "1000_ranks", args.ranks)
    print(f"runs made in {time.perf_counter() - start:.1f} s under {logdir}")

    site = work / "site" / "trainmon_structure_view-0.dist-info"
    site.mkdir(parents=True, exist_ok=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: trainmon-structure-view\nVersion: 0\n")
    (site / "entry_points.txt").write_text("[tensorboard_plugins]\ntrainmon = "
                                           "trainmon.tb_plugin.plugin:StructurePlugin\n")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site.parent), str(REPO)])}
    tb = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
                           "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{base}/data/plugins_listing", 120)
        plugin = f"{base}/data/plugin/trainmon"
        last = args.ranks - 1
        deep_tree = "tree?run=deep_layers&rank=0&step=1"
        for route in ("runs", "nan?run=deep_layers", "steps?run=deep_layers&rank=0", deep_tree, deep_tree,
                      f"steps?run=1000_ranks&rank={last}", f"tree?run=1000_ranks&rank={last}&step=1"):
            seconds, size = timed_get(f"{plugin}/{route}")
            print(f"GET {route}: {seconds * 1000:.0f} ms, {size / 1e3:.0f} kB")
        with urllib.request.urlopen(f"{plugin}/{deep_tree}") as response:
            print(f"deep tree: {len(json.loads(response.read())['nodes'])} nodes")
        executable, why = Browser.find()
        if executable is None:
            print(f"browser timings skipped: {why}")
            return
        browser = Browser(executable, work / "profile")
        try:
            start = time.perf_counter()
            browser.call("Page.navigate", url=f"{base}/data/plugin_entry.html?name=trainmon")
            browser.wait_for("document.body && document.body.dataset.nanLoaded === '1'", 600)
            browser.wait_for("document.querySelector('.tm-node.first-nan')", 600)
            seconds = time.perf_counter() - start
            node = browser.evaluate("document.querySelector('.first-nan').dataset.node")
            rows = browser.evaluate("document.querySelectorAll('.tm-node').length")
            print(f"page: first NaN ({node}) revealed {seconds:.2f} s after navigation; {rows} rows built")
            browser.evaluate("const r = document.getElementById('tm-run'); r.value = '1000_ranks';"
                             "r.dispatchEvent(new Event('change'))")
            browser.wait_for("document.getElementById('tm-rank-range').textContent.startsWith"
                             f"('{args.ranks} ranks')", 600)
            start = time.perf_counter()
            browser.evaluate(f"const k = document.getElementById('tm-rank'); k.value = '{last}';"
                             "k.dispatchEvent(new Event('change'))")
            browser.wait_for(f"document.getElementById('tm-status').textContent.includes('rank {last},')", 600)
            print(f"page: rank {last} of {args.ranks} shown {time.perf_counter() - start:.2f} s after it was typed")
            errors = [e for e in browser.console_errors() if not e.endswith("/favicon.ico")]
            print(f"console errors: {errors or 'none'}")
        finally:
            browser.close()
    finally:
        tb.terminate()
        tb.wait(20)


if __name__ == "__main__":
    main()
