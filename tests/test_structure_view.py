"""The structure view: its data (the runs it offers, module tree, non-finite path, comparison), the TensorBoard plugin
loaded through its entry point by a real `tensorboard` process, and the page in a real headless browser at 1600 x 1000,
its colours read from screenshots."""
from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

from tb_server import tensorboard_server
from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.demo import DEMO_CONFIG
from trainmon.tb_plugin import data

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "watch"))
from runs import generate, watch_once  # noqa: E402

FAULT_MODULE, FAULT_STEP = "layers.1.mlp.0", 2
# a 4-rank run (benchmarks/generate_run.py): an Inf enters rank 2's layers.3 at step 6, all ranks have it from step 7
FOUR_RANKS, FOUR_STEP, FOUR_ORIGIN = "four_ranks", 6, 2
CONFIG = dict(targets={}, all_xy=True, xy_distribution=True, wg_distribution=True, sentinel=True, print_struct=True,
              format=["db"], ops=DEMO_CONFIG["ops"], dump={"steps": [1, FAULT_STEP]}, strict=True)


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


def _age(run: Path, seconds_ago: float) -> None:
    """Dates every file and directory of a run `seconds_ago` (the view opens the newest run holding a NaN/Inf)."""
    import time
    stamp = time.time() - seconds_ago
    for path in [run, *run.rglob("*")]:
        os.utime(path, (stamp, stamp))


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """A logdir holding two runs of the same job, `faulty` (an Inf injected at FAULT_MODULE) and, made after it,
    `clean`; and, older than both, a 4-rank run."""
    root = tmp_path_factory.mktemp("structure")
    config = root / "config.json"
    config.write_text(json.dumps(CONFIG))
    logdir = root / "monitor_output"
    logdir.mkdir()
    saved = os.environ.get("MONITOR_OUTPUT_DIR")
    try:
        for name, faulty in (("faulty", True), ("clean", False)):
            shutil.move(str(_train(root / f"out_{name}", config, faulty)), str(logdir / name))
    finally:
        if saved is None:
            os.environ.pop("MONITOR_OUTPUT_DIR", None)
        else:
            os.environ["MONITOR_OUTPUT_DIR"] = saved
    generate(logdir / FOUR_RANKS, ranks=4, steps=10, inf_step=FOUR_STEP, origin=FOUR_ORIGIN)
    for name, seconds_ago in ((FOUR_RANKS, 300), ("faulty", 200), ("clean", 100)):
        _age(logdir / name, seconds_ago)
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


@pytest.mark.slow
def test_the_runs_offered_are_those_under_the_logdir_and_those_its_watch_views_show(logdir, tmp_path):
    names = data.run_names(logdir)
    assert names == {name: logdir / name for name in ("clean", "faulty", FOUR_RANKS)}
    assert [data.RunData(names[n]).holds_nonfinite() for n in ("clean", "faulty", FOUR_RANKS)] == [False, True, True]
    # `tensorboard --logdir <run>/watch`, as the demo prints it: the daemon's state file names its run
    view = tmp_path / "faulty_view"
    assert watch_once(logdir / "faulty", "--logdir", view, "--heatmap-every", 1000).returncode == 0
    assert data.run_names(view) == {"faulty": (logdir / "faulty").resolve()}
    assert data.run_names(tmp_path) == {"faulty": (logdir / "faulty").resolve()}  # a view below the logdir too


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
    # siblings in model order (module_struct.json's), not by name: the embeddings before the blocks and the head
    in_model = [name for name, _ in model.named_modules()]
    children = [n["id"] for n in tree["nodes"] if n["parent"] == ""]
    assert children == [name for name in in_model if name and "." not in name] != sorted(children)
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


def test_the_steps_screened_at_once_hold_every_divergent_record(logdir):
    """The comparison judges record by record only the steps `divergent_steps` finds: those must hold every record
    that `align` judges diverged over all steps."""
    from trainmon import open_run
    from trainmon.compare.records import DIVERGED, align, divergent_steps
    with open_run(logdir / "clean") as clean, open_run(logdir / "faulty") as faulty:
        diverged = {r.step for r in align(clean, faulty, [0]) if r.verdict == DIVERGED}
        screened = divergent_steps(clean, faulty, 0)
        assert diverged == {FAULT_STEP, FAULT_STEP + 1} and diverged <= set(screened)
        assert divergent_steps(clean, clean, 0) == []


# ----------------------------------------------------------------------------------- through TensorBoard
@pytest.fixture(scope="module")
def tensorboard(logdir, tmp_path_factory):
    """TensorBoard serving `logdir`, the plugin found through its entry point."""
    try:
        with tensorboard_server(logdir, tmp_path_factory.mktemp("site")) as base:
            yield base
    except RuntimeError as err:
        pytest.fail(str(err))


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
    status, runs = _get(f"{plugin}/runs")
    assert status == 200 and [(r["run"], r["ranks"], r["nonfinite"]) for r in runs["runs"]] == [
        ("clean", [0], False), ("faulty", [0], True), (FOUR_RANKS, [0, 1, 2, 3], True)]
    assert runs["open"] == "faulty"  # the newest run holding a NaN/Inf, though a clean one came after it
    status, tree = _get(f"{plugin}/tree?run=faulty&rank=0&step={FAULT_STEP}")
    assert status == 200 and any(n["id"] == FAULT_MODULE and n["nonfinite"] for n in tree["nodes"])
    assert _get(f"{plugin}/tree?run=faulty&rank=0&step=x")[0] == 400
    assert _get(f"{plugin}/steps?run=faulty&rank=7")[0] == 500
    outside = urllib.parse.quote("../..")
    status, body = _get(f"{plugin}/steps?run={outside}&rank=0")
    assert status == 400 and "not a run that /runs lists" in body["error"]
    with urllib.request.urlopen(f"{plugin}/index.js") as response:
        script = response.read().decode()
    assert "export async function render" in script and "http" not in script.replace("HTTP", "")


# --------------------------------------------------------------------------------------- in a browser
# The view's frame in TensorBoard's page (inside the shadow roots of TensorBoard's components).
_FRAME = ("(function find(root) { for (const e of root.querySelectorAll('*')) { if (e.tagName === 'IFRAME') return e;"
          " if (e.shadowRoot) { const r = find(e.shadowRoot); if (r) return r; } } return null; })(document)")


def in_view(expression: str) -> str:
    """`expression`, with `doc` and `win` the document and window of the view's frame (null before it exists)."""
    return (f"(() => {{ const frame = {_FRAME}; const doc = frame && frame.contentDocument; "
            f"const win = frame && frame.contentWindow; return doc && doc.body ? ({expression}) : null; }})()")


@pytest.mark.slow
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


def _box(browser, selector: str) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) in the page's pixels of the first element of the view matching `selector`."""
    return tuple(round(v) for v in browser.evaluate(in_view(
        f"(() => {{ const f = frame.getBoundingClientRect(); const r = doc.querySelector({json.dumps(selector)})"
        ".getBoundingClientRect(); return [f.left + r.left, f.top + r.top, f.left + r.right, f.top + r.bottom]; })()")))


def _near(pixel, rgb: tuple[int, int, int], tolerance: int = 3) -> bool:
    return all(abs(int(p) - c) <= tolerance for p, c in zip(pixel, rgb))


def _select(view, element_id: str, value) -> None:
    view(f"(() => {{ const e = doc.getElementById('{element_id}'); e.value = '{value}';"
         " e.dispatchEvent(new win.Event('change')); return true; })()")


def test_marks_follow_the_step_and_rank_shown_and_stay_readable_at_1600_px(tensorboard, browser):
    """Screenshots at 1600 x 1000: the path mark at its step and rank only, the first NaN's label white on red when the
    comparison marks its node too, the records' columns without a scroll; another run opens at its first NaN."""
    def view(expression):
        return browser.evaluate(in_view(expression))

    browser.call("Page.navigate", url=f"{tensorboard}/#trainmon")
    browser.wait_for(in_view(f"doc.querySelector('.tm-node.first-nan[data-node=\"{FAULT_MODULE}\"]')"), 120)
    # every column of the records' table in view without a horizontal scroll, even where every figure is as wide as
    # one can be (six significant digits of a small negative number)
    view("[...doc.querySelectorAll('#tm-details td:nth-child(n+4)')].forEach(td => td.textContent = '-0.000155813')"
         " || true")
    view("[...doc.querySelectorAll('#tm-details td:nth-child(1)')].forEach(td => td.textContent = 'grad_unreduced')"
         " || true")
    assert view("doc.getElementById('tm-details').scrollWidth <= doc.getElementById('tm-details').clientWidth")
    assert _box(browser, "#tm-details th:last-child")[2] <= 1600
    # the path the NaN took, at its step: a red left border
    left, top, _, bottom = _box(browser, '.tm-node.nan-path[data-node="layers.1"]')
    assert _near(browser.screenshot()[(top + bottom) // 2, left + 1], (242, 139, 130))
    # compared with the clean run: the first NaN's node diverged too, and stays white on red
    _select(view, "tm-baseline", "clean")
    row = f'.tm-node.first-nan[data-node="{FAULT_MODULE}"]'
    browser.wait_for(in_view(f"doc.querySelector('.first-divergent.diverged{row}')"))
    pixels = browser.screenshot()
    left, top, right, bottom = _box(browser, row)
    assert _near(pixels[(top + bottom) // 2, right - 8], (197, 34, 31))  # the row, away from its text
    left, top, right, bottom = _box(browser, f"{row} .tm-label")
    label = pixels[top:bottom, left:right].reshape(-1, 3)
    assert (label.min(axis=1) > 230).sum() >= 5 and (label.max(axis=1) < 250).sum() >= 5  # white text on its red
    # a clean step of the same rank: no mark is left on
    _select(view, "tm-step", FAULT_STEP - 1)
    browser.wait_for(in_view(f"doc.body.dataset.shown === 'faulty:0:{FAULT_STEP - 1}'"))
    assert view("doc.querySelectorAll('.tm-node.nan-path, .tm-node.first-nan').length") == 0
    # another run opens at its first NaN (rank 2 there), and another rank of it shows the path there
    _select(view, "tm-baseline", "")
    _select(view, "tm-run", FOUR_RANKS)
    browser.wait_for(in_view("doc.querySelector('.tm-node.first-nan[data-node=\"layers.3\"]')"), 120)
    assert (view("doc.getElementById('tm-rank').value"), view("doc.getElementById('tm-step').value")) == \
        (str(FOUR_ORIGIN), str(FOUR_STEP))
    view("(() => { const k = doc.getElementById('tm-rank'); k.value = '0'; k.dispatchEvent(new win.Event('change'));"
         " return true; })()")
    browser.wait_for(in_view(f"doc.body.dataset.shown === '{FOUR_RANKS}:0:{FOUR_STEP}'"))
    marked = view("[...doc.querySelectorAll('.tm-node.nan-path')].map(n => n.dataset.node)")
    assert "(collectives)" in marked and view("doc.querySelectorAll('.tm-node.first-nan').length") == 0
    assert browser.console_errors() == []
