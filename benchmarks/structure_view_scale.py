"""The structure view at scale: a 100-layer model, and runs of 1,000 ranks, served by TensorBoard.

    python benchmarks/structure_view_scale.py [--layers 100] [--ranks 1000] [--work DIR] [--demo LOGDIR]

Trains a `--layers`-layer TinyGPT for 2 steps with a NaN injected in the last layer at step 1 (every
statistic family, module_struct.json, the database), and the same without the NaN; then makes runs of `--ranks`
ranks whose rank directories hold copies of those runs' databases (`--layers` layers x `--ranks` ranks, with the NaN
and without). Starts `tensorboard --logdir` with the plugin, and prints the time of each plugin route (the
comparison of rank `--ranks - 1` of the two big runs the first time and cached), the size of the tree it sends,
and, when Chromium and websocket-client are there, the time until the page shows the first NaN with its node
revealed, until it shows rank `--ranks - 1` after the rank is typed in, and until it shows the first divergence
from the clean run once that is chosen as the baseline.

`--demo LOGDIR`: a logdir holding two runs of `trainmon demo` (one with `--inject nan`, one without): the time of
the comparison of the first with the second the first time, through its own TensorBoard.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

from cdp import Browser  # noqa: E402
from tb_server import tensorboard_server  # noqa: E402
from trainmon import TrainerMon  # noqa: E402
from trainmon.demo import TinyGPT, lm_loss, synthetic_batch  # noqa: E402

CONFIG = dict(targets={}, all_xy=True, xy_distribution=True, wg_distribution=True, param_distribution=True,
              mv_distribution=True, sentinel=True, print_struct=True, format=["db"],
              ops=["norm", "min", "max", "mean", "nans", "infs"])


def train(out: Path, config: Path, layers: int, nan_layer: Optional[int]) -> Path:
    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, hidden=16, layers=layers, heads=2, seq=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = {"now": 0}
    if nan_layer is not None:
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
        for name in ("monitor.db", "module_struct.json"):
            os.link(source / "rank_0" / name, rank_dir / name)
        (rank_dir / "run.json").write_text(json.dumps({**meta, "rank": rank, "world_size": ranks}))


def timed_get(url: str) -> tuple[float, int]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as response:
        body = response.read()
    return time.perf_counter() - start, len(body)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=600) as response:
        return json.loads(response.read())


def demo_comparison(logdir: Path, site: Path) -> None:
    """The first comparison of the demo's injected run with its clean run, through TensorBoard."""
    with tensorboard_server(logdir, site) as base:
        plugin = f"{base}/data/plugin/trainmon"
        runs = get_json(f"{plugin}/runs")["runs"]
        faulty = next(r["run"] for r in runs if r["nonfinite"])
        clean = next(r["run"] for r in runs if not r["nonfinite"])
        step = get_json(f"{plugin}/nan?run={faulty}")["first"]["step"]
        route = f"compare?run={faulty}&baseline={clean}&rank=0&step={step}"
        for when in ("first time", "cached"):
            seconds, size = timed_get(f"{plugin}/{route}")
            print(f"demo: GET {route} ({when}): {seconds * 1000:.0f} ms, {size / 1e3:.0f} kB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--work", help="directory for the runs (default: a temporary one)")
    parser.add_argument("--demo", metavar="LOGDIR", help="a logdir with the demo's injected run and a clean one")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="structure-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.demo:
        demo_comparison(Path(args.demo), work / "demo_site")
    config = work / "config.json"
    config.write_text(json.dumps(CONFIG))
    logdir = work / "monitor_output"
    start = time.perf_counter()
    deep = train(work / "deep", config, args.layers, args.layers - 1)
    clean = train(work / "deep_clean", config, args.layers, None)
    small = train(work / "small", config, 2, 1)
    big, big_clean = f"{args.layers}_layers_x_{args.ranks}_ranks", f"{args.layers}_layers_x_{args.ranks}_ranks_clean"
    many_ranks(deep, logdir / big, args.ranks)
    many_ranks(clean, logdir / big_clean, args.ranks)
    many_ranks(small, logdir / "1000_ranks", args.ranks)
    # copied last (new modification times): the page opens on the newest run holding a NaN, the 100-layer one
    shutil.copytree(clean, logdir / "deep_clean", copy_function=shutil.copyfile)
    shutil.copytree(deep, logdir / "deep_layers", copy_function=shutil.copyfile)
    print(f"runs made in {time.perf_counter() - start:.1f} s under {logdir}")

    with tensorboard_server(logdir, work / "site") as base:
        plugin = f"{base}/data/plugin/trainmon"
        last = args.ranks - 1
        deep_tree = "tree?run=deep_layers&rank=0&step=1"
        compare = f"compare?run={big}&baseline={big_clean}&rank={last}&step=1"
        for route in ("runs", "nan?run=deep_layers", "steps?run=deep_layers&rank=0", deep_tree, deep_tree,
                      f"steps?run=1000_ranks&rank={last}", f"tree?run=1000_ranks&rank={last}&step=1", compare,
                      compare):
            seconds, size = timed_get(f"{plugin}/{route}")
            print(f"GET {route}: {seconds * 1000:.0f} ms, {size / 1e3:.0f} kB")
        print(f"deep tree: {len(get_json(f'{plugin}/{deep_tree}')['nodes'])} nodes")
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
            opened = browser.evaluate("document.getElementById('tm-run').value")
            print(f"page: opened on {opened}, first NaN ({node}) revealed {seconds:.2f} s after navigation; "
                  f"{rows} rows built")
            start = time.perf_counter()
            browser.evaluate("{ const b = document.getElementById('tm-baseline'); b.value = 'deep_clean';"
                             " b.dispatchEvent(new Event('change')); }")
            browser.wait_for("document.getElementById('tm-first-divergent')", 600)
            print(f"page: first divergence of deep_layers from deep_clean shown {time.perf_counter() - start:.2f} s "
                  "after the baseline was chosen (the first comparison of these runs)")
            browser.evaluate("{ const b = document.getElementById('tm-baseline'); b.value = '';"
                             " b.dispatchEvent(new Event('change')); }")
            browser.evaluate("{ const r = document.getElementById('tm-run'); r.value = '1000_ranks';"
                             " r.dispatchEvent(new Event('change')); }")
            browser.wait_for(f"document.getElementById('tm-rank-range').textContent.startsWith('{args.ranks} ranks')"
                             " && (document.body.dataset.shown || '').startsWith('1000_ranks:')", 600)
            start = time.perf_counter()
            browser.evaluate(f"{{ const k = document.getElementById('tm-rank'); k.value = '{last}';"
                             " k.dispatchEvent(new Event('change')); }")
            browser.wait_for(f"document.body.dataset.shown.startsWith('1000_ranks:{last}:')", 600)
            print(f"page: rank {last} of {args.ranks} shown {time.perf_counter() - start:.2f} s after it was typed")
            errors = [e for e in browser.console_errors() if not e.endswith("/favicon.ico")]
            print(f"console errors: {errors or 'none'}")
        finally:
            browser.close()


if __name__ == "__main__":
    main()
