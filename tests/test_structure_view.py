"""The structure view: its data (module tree, non-finite path, comparison), the TensorBoard plugin loaded through
its entry point by a real `tensorboard` process, and the page in a real headless browser."""
from __future__ import annotations

import configparser
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

from cdp import Browser, free_port, wait_for_http
from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.tb_plugin import data

REPO = Path(__file__).resolve().parents[1]
FAULT_MODULE, FAULT_STEP = "layers.1.mlp.0", 2
CONFIG = dict(targets={}, all_xy=True, xy_distribution=True, wg_distribution=True, sentinel=True, print_struct=True,
              format=["db"], ops=["norm", "max", "nans", "infs"], dump={"steps": [1, FAULT_STEP]}, strict=True)


def _train(out: Path, config: Path, faulty: bool) -> Path:
    """Trains 4 steps of the tiny model into `out`; with `faulty`, FAULT_MODULE's output is Inf at FAULT_STEP."""
    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    model = make_model(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = {"now": 0}
    if faulty:
        dict(model.named_modules())[FAULT_MODULE].register_forward_hook(
            lambda m, args, output: output * float("inf") if step["now"] == FAULT_STEP else None)
    monitor = TrainerMon(str(config)).set_monitor(model, optimizer=optimizer)
    run_steps(model, optimizer, 4, on_step=lambda s: step.update(now=s + 1))
    monitor.stop()
    return next(out.iterdir())


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """A logdir holding two runs of the same job: `clean`, and `faulty` (an Inf injected at FAULT_MODULE)."""
    root = tmp_path_factory.mktemp("structure")
    config = root / "config.json"
    config.write_text(json.dumps(CONFIG))
    logdir = root / "monitor_output"
    logdir.mkdir()
    saved = os.environ.get("MONITOR_OUTPUT_DIR")
    try:
        for name, faulty in (("clean", False), ("faulty", True)):
            shutil.move(str(_train(root / f"out_{name}", config, faulty)), str(logdir / name))
    finally:
        if saved is None:
            os.environ.pop("MONITOR_OUTPUT_DIR", None)
        else:
            os.environ["MONITOR_OUTPUT_DIR"] = saved
    return logdir


# ------------------------------------------------------------------------------------------------ data
def test_records_belong_to_their_module_nodes():
    assert data.node_of("actv", "layers.0.attn.output") == ("layers.0.attn", "output")
    assert data.node_of("actv", ".input") == ("", "input")
    assert data.node_of("actv_grad", "layers.0#1.input_1") == ("layers.0", "#1.input_1")
    assert data.node_of("grad_reduced", "layers.0.mlp.0.weight") == ("layers.0.mlp.0", "weight")
    assert data.node_of("save", "layers.0.attn.scores") == ("layers.0.attn", "scores")
    assert data.node_of("save", "router_logits") == ("", "router_logits")
    assert data.node_of("comm", "all_reduce[0, 1]@default#3.input")[0] == data.COLLECTIVES
    assert data.node_of_event({"module": "layers.0#1", "tensor": "grad_output"}) == "layers.0"
    assert data.node_of_event({"module": "layers.0.mlp.0.weight", "tensor": "reduced_grad"}) == "layers.0.mlp.0"
    assert data.node_of_event({"module": "gate", "tensor": "save"}) == ""


def test_the_tree_holds_every_module_with_its_class_and_figures(logdir):
    run = data.RunData(logdir / "faulty")
    assert run.ranks == [0] and run.steps(0) == [0, 1, 2, 3]
    tree = data.step_tree(run, 0, FAULT_STEP)
    nodes = {n["id"]: n for n in tree["nodes"]}
    model = make_model(layers=2)
    assert set(nodes) == {name for name, _ in model.named_modules()}
    assert all(nodes[name]["class"] == type(module).__name__ for name, module in model.named_modules())
    position = {n["id"]: i for i, n in enumerate(tree["nodes"])}
    assert all(position[n["parent"]] < position[n["id"]] for n in tree["nodes"] if n["parent"] is not None)
    fault = nodes[FAULT_MODULE]
    output = next(r for r in fault["records"] if r["family"] == "actv" and r["leaf"] == "output")
    assert output["infs"] > 0 and output["norm"] == "inf" and fault["nonfinite"] > 0
    assert {r["leaf"] for r in fault["records"] if r["family"] == "grad_reduced"} == {"weight", "bias"}
    # the figures are the read layer's, at this step
    from trainmon import open_run
    with open_run(logdir / "faulty") as frames:
        frame = frames.family("actv", steps=FAULT_STEP - 1)
    row = frame[frame.name == "layers.0.attn.output"].iloc[0]
    earlier = {n["id"]: n for n in data.step_tree(run, 0, FAULT_STEP - 1)["nodes"]}["layers.0.attn"]
    assert next(r for r in earlier["records"] if r["leaf"] == "output")["norm"] == row["norm"]
    assert earlier["nonfinite"] == 0


def test_the_nan_path_and_the_comparison_name_the_faulty_module(logdir):
    path = data.nan_path(logdir / "faulty")
    assert (path["first"]["node"], path["first"]["step"], path["first"]["tensor"]) == (FAULT_MODULE, FAULT_STEP,
                                                                                       "output")
    assert path["chain"] and all("node" in c for c in path["chain"])
    assert data.nan_path(logdir / "clean")["first"] is None
    compared = data.comparison(data.RunData(logdir / "faulty"), data.RunData(logdir / "clean"), 0, FAULT_STEP)
    first = compared["first_divergent"]
    assert (first["node"], first["family"], first["step"]) == (FAULT_MODULE, "actv", FAULT_STEP)
    nodes = compared["nodes"]
    assert nodes[FAULT_MODULE]["diverged"] > 0 and nodes[FAULT_MODULE]["max_rel"] == "inf"
    assert nodes[FAULT_MODULE]["nonfinite_mismatch"] > 0  # from both runs' tensor dumps of the step
    # the step before the fault: the same records, the same dumped tensors
    before = data.comparison(data.RunData(logdir / "faulty"), data.RunData(logdir / "clean"), 0, FAULT_STEP - 1)
    assert before["nodes"][FAULT_MODULE] == {"max_rel": 0.0, "diverged": 0, "cosine": pytest.approx(1.0),
                                             "max_abs": 0.0, "nonfinite_mismatch": 0}
    assert data.comparison(data.RunData(logdir / "clean"), data.RunData(logdir / "clean"), 0,
                           FAULT_STEP)["first_divergent"] is None


# ----------------------------------------------------------------------------------- through TensorBoard
@pytest.fixture(scope="module")
def tensorboard(logdir, tmp_path_factory):
    """`python -m tensorboard.main` serving `logdir`, with trainmon's plugin found through the entry point that
    setup.cfg declares: the installed one, or, where the installed trainmon does not declare it (an install
    older than the checkout), the same written here as a distribution's metadata on the path."""
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    entry_points = parser["options.entry_points"]["tensorboard_plugins"].strip()
    site = tmp_path_factory.mktemp("site")
    name, _, value = (part.strip() for part in entry_points.partition("="))
    installed = {(e.name, e.value) for e in importlib.metadata.entry_points(group="tensorboard_plugins")}
    if (name, value) not in installed:  # TensorBoard refuses a plugin name declared twice
        dist = site / "trainmon_structure_view-0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: trainmon-structure-view\nVersion: 0\n")
        (dist / "entry_points.txt").write_text(f"[tensorboard_plugins]\n{entry_points}\n")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host",
                                "127.0.0.1", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{base}/data/plugins_listing", 120)
    except OSError:
        process.kill()
        pytest.fail(f"tensorboard did not start: {process.communicate()[1][-3000:]}")
    yield base
    process.terminate()
    process.wait(20)


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_tensorboard_loads_the_plugin_from_its_entry_point_and_serves_the_view(tensorboard):
    _, listing = _get(f"{tensorboard}/data/plugins_listing")
    assert listing["trainmon"]["enabled"] is True
    assert listing["trainmon"]["loading_mechanism"] == {"type": "IFRAME",
                                                         "module_path": "/data/plugin/trainmon/index.js"}
    plugin = f"{tensorboard}/data/plugin/trainmon"
    assert _get(f"{plugin}/runs") == (200, {"runs": [{"run": "clean", "ranks": [0]}, {"run": "faulty", "ranks": [0]}]})
    status, tree = _get(f"{plugin}/tree?run=faulty&rank=0&step={FAULT_STEP}")
    assert status == 200 and any(n["id"] == FAULT_MODULE and n["nonfinite"] for n in tree["nodes"])
    assert _get(f"{plugin}/tree?run=faulty&rank=0&step=x")[0] == 400
    assert _get(f"{plugin}/steps?run=faulty&rank=7")[0] == 500
    outside = urllib.parse.quote("../..")
    status, body = _get(f"{plugin}/steps?run={outside}&rank=0")
    assert status == 400 and "not under the logdir" in body["error"]
    with urllib.request.urlopen(f"{plugin}/index.js") as response:
        script = response.read().decode()
    assert "export async function render" in script and "http" not in script.replace("HTTP", "")


# --------------------------------------------------------------------------------------- in a browser
@pytest.fixture
def browser(tmp_path):
    executable, why = Browser.find()
    if executable is None:
        pytest.skip(why)
    page = Browser(executable, tmp_path / "profile")
    yield page
    page.close()


# The view's frame in TensorBoard's page (inside the shadow roots of TensorBoard's components).
_FRAME = ("(function find(root) { for (const e of root.querySelectorAll('*')) { if (e.tagName === 'IFRAME') return e;"
          " if (e.shadowRoot) { const r = find(e.shadowRoot); if (r) return r; } } return null; })(document)")


def in_view(expression: str) -> str:
    """`expression`, with `doc` and `win` the document and window of the view's frame (null before it exists)."""
    return (f"(() => {{ const frame = {_FRAME}; const doc = frame && frame.contentDocument; "
            f"const win = frame && frame.contentWindow; return doc && doc.body ? ({expression}) : null; }})()")


def test_the_page_in_a_browser_highlights_the_first_nan_and_finds_a_node(tensorboard, browser):
    def view(expression):
        return browser.evaluate(in_view(expression))

    # TensorBoard's own page, on the "trainmon structure" tab, which loads the view in a frame
    browser.call("Page.navigate", url=f"{tensorboard}/#trainmon")
    browser.wait_for(in_view("doc.body.dataset.nanLoaded === '1'"), 120)
    # nan-analyze's first non-finite tensor: the view moved to its step and expanded the tree down to it
    browser.wait_for(in_view(f"doc.querySelector('.tm-node.first-nan[data-node=\"{FAULT_MODULE}\"]')"))
    assert view("doc.querySelectorAll('.tm-node.first-nan').length") == 1
    assert view("doc.getElementById('tm-step').value") == str(FAULT_STEP)
    assert view("doc.getElementById('tm-run').value") == "faulty"
    assert "layers.1.mlp.0 forward output" in view("doc.getElementById('tm-first-nan').textContent")
    assert view("doc.getElementById('tm-selected').textContent") == FAULT_MODULE
    assert view("win.getComputedStyle(doc.querySelector('.tm-node.first-nan')).backgroundColor") == "rgb(197, 34, 31)"
    # the block it is in: non-finite too, and on the path the NaN took after it
    assert set(view("doc.querySelector('.tm-node[data-node=\"layers.1\"]').className").split()) == \
        {"tm-node", "nonfinite", "nan-path"}
    # search: typed into the box, a hit for a collapsed module; Enter reveals and selects it
    view("doc.getElementById('tm-search').focus()")
    browser.call("Input.insertText", text="0.attn.pro")
    browser.wait_for(in_view("doc.querySelector('#tm-search-results .tm-hit')"))
    assert view("[...doc.querySelectorAll('#tm-search-results .tm-hit')].map(h => h.dataset.node)") == \
        ["layers.0.attn.proj"]
    assert not view("doc.querySelector('.tm-node[data-node=\"layers.0.attn.proj\"]')")  # built when revealed
    browser.call("Input.dispatchKeyEvent", type="keyDown", key="Enter", code="Enter", windowsVirtualKeyCode=13)
    browser.wait_for(in_view("doc.querySelector('.tm-node.selected[data-node=\"layers.0.attn.proj\"]')"))
    assert view("doc.getElementById('tm-selected').textContent") == "layers.0.attn.proj"
    # a baseline run: the first divergent node gets its mark
    view("(() => { const b = doc.getElementById('tm-baseline'); b.value = 'clean';"
         " b.dispatchEvent(new win.Event('change')); return true; })()")
    browser.wait_for(in_view(f"doc.querySelector('.tm-node.first-divergent[data-node=\"{FAULT_MODULE}\"]')"))
    assert "first divergence from clean" in view("doc.getElementById('tm-first-divergent').textContent")
    assert browser.console_errors() == []
    foreign = [u for u in browser.requested_urls() if not u.startswith(tensorboard)]
    assert foreign == [], "the page fetched something that TensorBoard does not serve"
