"""The daemon's view as a user opens it, in TensorBoard's own page in headless Chromium at 1600 x 1000:
`trainmon demo --inject nan`, then the `tensorboard --logdir` it prints; and a 4-rank run whose NaN/Inf starts on rank
2, after `trainmon watch --once`. The first page of the first group holds the headline, the origin layer's chart draws
the failure from its step on (screenshot pixels), the text's top entry names the incident, and the structure tab opened
from the demo's command highlights the first NaN."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cdp import Browser
from tb_server import tensorboard_server

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "watch"))
from runs import generate, watch_once  # noqa: E402

pytestmark = pytest.mark.slow  # a demo job with its daemon, TensorBoard and Chromium

STEPS = 20
INJECTED = STEPS // 2  # the demo's Inf: layers.1.mlp.0's output, half-way through
FOUR_STEP, FOUR_ORIGIN = 6, 2
# TensorBoard's components keep their content in shadow roots: every element below the document
_DEEP = ("(function all(root, out) { for (const e of root.querySelectorAll('*')) { out.push(e);"
         " if (e.shadowRoot) all(e.shadowRoot, out); } return out; })(document, [])")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """`trainmon demo --inject nan` in an empty directory: the logdir of the `tensorboard` command it prints."""
    cwd = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("MONITOR_OUTPUT_DIR", None)
    done = subprocess.run([sys.executable, "-m", "trainmon.cli", "demo", "--steps", str(STEPS), "--inject", "nan"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [logdir] = re.findall(r"^\s*\d\. tensorboard --logdir (\S+)", done.stdout, re.MULTILINE)
    return cwd / logdir


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> Path:
    """The view of a 4-rank run (benchmarks/generate_run.py) whose Inf enters rank 2's layers.3 at FOUR_STEP."""
    root = tmp_path_factory.mktemp("four")
    run = generate(root / "run", ranks=4, steps=12, inf_step=FOUR_STEP, origin=FOUR_ORIGIN)
    assert watch_once(run, "--logdir", root / "view").returncode == 0
    return root / "view"


@pytest.fixture(scope="module")
def served(demo, tmp_path_factory):
    with tensorboard_server(demo, tmp_path_factory.mktemp("site")) as base:
        yield base


def _open(browser: Browser, url: str, ready: str, timeout: float = 120) -> None:
    browser.call("Page.navigate", url=url)
    browser.wait_for(ready, timeout)


def test_the_first_page_of_the_first_group_holds_the_headline(served, browser):
    _open(browser, f"{served}/#timeseries", "document.querySelector('metrics-card-grid .card-space')")
    groups = browser.evaluate("[...document.querySelectorAll('metrics-card-group-toolbar .group-title')]"
                              ".map(t => t.textContent.trim())")
    assert groups[0] == "Overview" and groups[1] == "Worst tensor", groups
    first = "document.querySelector('metrics-card-grid')"  # the first group's cards, its first page
    assert browser.evaluate(f"{first}.querySelectorAll('.card-space').length") <= 12  # one page of TensorBoard's
    titles = set()
    for index in range(browser.evaluate(f"{first}.querySelectorAll('.card-space').length")):
        card = f"{first}.querySelectorAll('.card-space')[{index}]"
        browser.evaluate(f"{card}.scrollIntoView()")  # cards are drawn when they come into view
        browser.wait_for(f"{card}.querySelector('tb-truncated-path')")
        titles.add(browser.evaluate(f"{card}.querySelector('tb-truncated-path').title"))
    assert {"Overview/loss", "Overview/grad_norm", "Overview/nan_elements", "Overview/lr",
            "Overview/first_nonfinite_rank in layers.1 (actv)"} <= titles, titles  # where, and which rank
    assert all(t.startswith("Overview/") for t in titles) and len(titles) <= 12


def test_the_origin_layers_chart_draws_the_failure_from_its_step(served, browser):
    """`actv/norm of layers.1` (the Inf enters layers.1.mlp.0's output): the run `nonfinite_elements` draws its line
    from the incident step on, and TensorBoard logs no error drawing the chart."""
    _open(browser, f"{served}/#timeseries", "document.querySelector('metrics-tag-filter input')")
    browser.evaluate("document.querySelector('metrics-tag-filter input').focus()")
    browser.call("Input.insertText", text="^actv/norm of layers.1$")
    card = ("[...document.querySelectorAll('card-view')].find(c => (c.querySelector('tb-truncated-path') || {})"
            ".title === 'actv/norm of layers.1')")
    browser.wait_for(f"{card} && {card}.querySelector('line-chart canvas')", 60)
    swatch = browser.evaluate("[...document.querySelectorAll('runs-data-table tb-data-table-content-row')]"
                              ".find(r => r.innerText.includes('nonfinite_elements'))"
                              ".querySelector('.run-color-swatch').style.background")
    colour = np.array([int(v) for v in re.findall(r"\d+", swatch)[:3]])
    browser.evaluate("document.body.click()")  # closes the filter's suggestions over the chart
    time.sleep(2)  # the chart is drawn by a worker after its data arrive
    left, top, right, bottom = (round(v) for v in browser.evaluate(
        f"(() => {{ const r = {card}.querySelector('line-chart').getBoundingClientRect();"
        " return [r.left, r.top, r.right, r.bottom]; })()"))
    chart = browser.screenshot()[top:bottom, left:right].astype(int)
    columns = np.flatnonzero((np.abs(chart - colour).max(axis=2) <= 12).any(axis=0))
    assert len(columns) > 20, "the nonfinite_elements line is not drawn"
    # the steps 0..STEPS-1 span the plot: the line starts near the incident step's place, half-way
    assert 0.35 < columns.min() / (right - left) < 0.75, (columns.min(), right - left)
    assert not [e for e in browser.console_errors() if "radius is NaN" in e]


def _top_text_entry(browser: Browser) -> str:
    """The text of the first entry of the first card of TensorBoard's text dashboard."""
    markdown = f"({_DEEP}.filter(e => e.id === 'markdown').map(e => e.innerText.trim()).filter(text => text))"
    browser.wait_for(f"{markdown}.some(text => text.includes('NaN'))", 120)
    return browser.evaluate(f"{markdown}[0]")


def test_the_texts_top_entry_names_the_incident_on_one_rank(served, browser):
    _open(browser, f"{served}/#text", "document.readyState === 'complete'")
    entry = _top_text_entry(browser)
    assert f"step {INJECTED} micro-step 0: first NaN/Inf in layers.1" in entry and "on rank 0" in entry, entry
    assert "layers.1.mlp.0.output" in entry


def test_the_texts_top_entry_names_the_incident_on_four_ranks(four_ranks, browser, tmp_path):
    with tensorboard_server(four_ranks, tmp_path / "site") as base:
        _open(browser, f"{base}/#text", "document.readyState === 'complete'")
        entry = _top_text_entry(browser)
    assert f"step {FOUR_STEP} micro-step 0: first NaN/Inf in layers.3" in entry, entry
    assert f"on rank {FOUR_ORIGIN}" in entry


def test_the_structure_tab_from_the_demos_command_highlights_the_first_nan(demo, served, browser):
    frame = ("(function find(root) { for (const e of root.querySelectorAll('*')) { if (e.tagName === 'IFRAME')"
             " return e; if (e.shadowRoot) { const r = find(e.shadowRoot); if (r) return r; } } return null; })"
             "(document)")
    doc = f"({frame} && {frame}.contentDocument)"
    _open(browser, f"{served}/#trainmon", f"{doc} && {doc}.querySelector('.tm-node.first-nan')")
    assert browser.evaluate(f"{doc}.querySelector('.tm-node.first-nan').dataset.node") == "layers.1.mlp.0"
    run = json.loads((demo / "watch_state.json").read_text())["run"]
    assert browser.evaluate(f"{doc}.getElementById('tm-run').value") == Path(run).name
    assert browser.evaluate(f"{doc}.getElementById('tm-step').value") == str(INJECTED)
    # module_struct.json: the classes, and the blocks in model order
    assert browser.evaluate(f"{doc}.querySelector('.tm-node[data-node=\"layers.1.mlp\"] .tm-class').textContent") \
        == "Sequential"
    assert browser.console_errors() == []
