"""What opening `trainmon watch`'s view in TensorBoard costs: tags, event-file size, TensorBoard's load, each dashboard.

    python benchmarks/tensorboard_view.py /tmp/tbv/r256                    # generated first when missing:
                                                                           # 256 ranks x 1,000 steps
    python benchmarks/tensorboard_view.py RUN --ranks 64 --steps 300 --json out.json
    python benchmarks/tensorboard_view.py RUN --logdir RUN/watch --no-watch   # a view already written (the demo's)
    python benchmarks/tensorboard_view.py RUN --logdir /tmp/v --watch-args "--detail . --ranks 0"   # all selected

1. `trainmon watch RUN --once --logdir LOGDIR` (timed; LOGDIR defaults to RUN-tbview beside RUN, rewritten),
   unless `--no-watch`. Reported: the scalar, image and text tags TensorBoard serves, the event files' size
   against the rank databases' (`rank_*/monitor.db`).
2. TensorBoard on loopback (`python -m tensorboard.main --logdir LOGDIR --host 127.0.0.1 --port P
   --load_fast=false`, the Python data provider). `--reload blocking` (default) adds `--reload_task blocking
   --reload_interval 0`: the server answers once the whole logdir is loaded, so the load time is from the
   start until `/data/runs` lists the run and `/data/plugins_listing` answers. `--reload thread` is
   TensorBoard's default (the server answers at once and loads in a thread); loaded then means the tag
   lists are unchanged over 3 polls 1 s apart and a scalar tag's series reaches the last exported step.
3. Per dashboard, the requests its page makes when a user opens it (as the bundled frontend of this
   TensorBoard version does), sent one after the other (a worst case: a browser sends up to 6 at once):
   - scalars: `scalars/tags`, then per tag one POST `scalars/scalars_multirun` (tag, runs) — what the page
     does outside Colab (`scalars/scalars?run&tag` GETs in Colab);
   - time_series (the tab TensorBoard opens first): `timeseries/tags`, one POST `timeseries/timeSeries`
     per scalar and per image tag (one request each, as the page's cards do), `timeseries/imageData` for
     each image tag's latest step;
   - images: `images/tags`, `images/images?run&tag&sample=0` per tag, `images/individualImage` of each
     tag's latest step;
   - custom_scalars: `custom_scalars/layout`, then per chart and run one `custom_scalars/scalars?run&tag`
     whose tag is the chart's regexes joined as the page joins them (all charts; `open_only_s` counts
     those of the categories the layout opens, `by_category` each category's);
   - text: `text/tags`, `text/text?run&tag` per tag.
   Per dashboard: total seconds, requests, bytes, the slowest request. TensorBoard is stopped at the end.
4. With `--first-screen N` (before the dashboards' requests, so TensorBoard's caches are cold): N times, a fresh
   headless Chromium (tests/cdp.py) at 1600 x 1000 opens `#timeseries`, what a user sees first; `first_screen_s` is
   the time from the navigation until every card of the first group in view shows its axes and values,
   `first_lines_s` until each of them has also drawn a line (pixels of a run's colour in its chart, read from
   screenshots every 0.1 s).
5. A JSON summary on stdout (and in `--json FILE`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
MB = 2 ** 20


def generate(run: Path, ranks: int, steps: int) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, str(HERE / "generate_run.py"), str(run), "--ranks", str(ranks), "--steps",
                    str(steps)], check=True, env=ENV)
    return time.perf_counter() - started


def watch_once(run: Path, logdir: Path, extra: list[str]) -> float:
    subprocess.run(["rm", "-rf", str(logdir)], check=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trainmon.cli", "watch", str(run), "--once", "--logdir", str(logdir),
                           *extra], env=ENV, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"trainmon watch failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return wall


def sizes(run: Path, logdir: Path) -> dict:
    events = sum(p.stat().st_size for p in logdir.rglob("events.out.tfevents.*"))
    dbs = sorted(run.glob("rank_*/monitor.db"))
    db_bytes = sum(p.stat().st_size for p in dbs)
    return {"event_files": len(list(logdir.rglob("events.out.tfevents.*"))), "events_mb": round(events / MB, 2),
            "rank_dbs": len(dbs), "dbs_mb": round(db_bytes / MB, 2),
            "events_over_dbs": round(events / db_bytes, 4) if db_bytes else None}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Client:
    """Sends requests to TensorBoard on loopback and records each one's time and size."""

    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"
        self.log: list[dict] = []

    def get(self, path: str, params: dict | None = None, form: dict | None = None, raw: bool = False,
            timeout: float = 600.0):
        url = self.base + path + ("?" + urllib.parse.urlencode(params, doseq=True) if params else "")
        data = urllib.parse.urlencode(form, doseq=True).encode() if form is not None else None
        started = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=timeout) as answer:
            body = answer.read()
        seconds = time.perf_counter() - started
        self.log.append({"path": path, "params": params or form or {}, "s": seconds, "bytes": len(body)})
        return body if raw else json.loads(body)


def start_tensorboard(logdir: Path, port: int, reload: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
               "--port", str(port), "--load_fast=false"]
    if reload == "blocking":
        command += ["--reload_task", "blocking", "--reload_interval", "0"]
    return subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024)
    return float("nan")


def _tag_counts(client: Client) -> tuple:
    scalars = client.get("/data/plugin/scalars/tags")
    images = client.get("/data/plugin/images/tags")
    text = client.get("/data/plugin/text/tags")
    return (sum(len(tags) for tags in scalars.values()), sum(len(tags) for tags in images.values()),
            sum(len(tags) for tags in text.values()))


def wait_loaded(process: subprocess.Popen, client: Client, reload: str, last_step: int | None,
                timeout: float) -> float:
    """Seconds from TensorBoard's start until it serves the whole run (see the module docstring)."""
    started = time.perf_counter()
    deadline = started + timeout
    counts, stable = None, 0
    while time.perf_counter() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"TensorBoard exited ({process.returncode}):\n{process.stderr.read()[-4000:]}")
        try:
            runs = client.get("/data/runs", timeout=5)
            client.get("/data/plugins_listing", timeout=30)
        except (urllib.error.URLError, ConnectionError, socket.timeout, OSError):
            time.sleep(0.2)
            continue
        if runs and reload == "blocking":
            return time.perf_counter() - started
        if runs:
            now = _tag_counts(client)
            stable = stable + 1 if now == counts and now[0] else 0
            counts = now
            reached = True
            if last_step is not None and now[0]:
                scalars = client.get("/data/plugin/scalars/tags")
                run, tags = next(iter(scalars.items()))
                series = client.get("/data/plugin/scalars/scalars", {"run": run, "tag": next(iter(tags))})
                reached = bool(series) and series[-1][1] >= last_step
            if stable >= 2 and reached:
                return time.perf_counter() - started - 2.0  # the two confirming polls
        time.sleep(1.0)
    raise SystemExit(f"TensorBoard did not load {timeout:.0f} s after its start")


def _summary(client: Client, first: int) -> dict:
    requests = client.log[first:]
    slowest = max(requests, key=lambda r: r["s"])
    big = sorted(requests, key=lambda r: -r["s"])[:3]
    return {"s": round(sum(r["s"] for r in requests), 3), "requests": len(requests),
            "mean_ms": round(1000 * sum(r["s"] for r in requests) / len(requests), 1),
            "mb": round(sum(r["bytes"] for r in requests) / MB, 2),
            "slowest": {"path": slowest["path"], "params": {k: (v if len(str(v)) < 120 else str(v)[:120] + "...")
                                                          for k, v in slowest["params"].items()},
                        "s": round(slowest["s"], 3), "bytes": slowest["bytes"]},
            "top3_s": [round(r["s"], 3) for r in big]}


def scalars_dashboard(client: Client) -> dict:
    first = len(client.log)
    index = client.get("/data/plugin/scalars/tags")
    for run, tags in index.items():
        for tag in tags:
            client.get("/data/plugin/scalars/scalars_multirun", form={"tag": tag, "runs": [run]})
    return _summary(client, first)


def time_series_dashboard(client: Client) -> dict:
    first = len(client.log)
    index = client.get("/data/plugin/timeseries/tags")
    for tag in sorted({tag for tags in index["scalars"]["runTagInfo"].values() for tag in tags}):
        client.get("/data/plugin/timeseries/timeSeries",
                   form={"requests": json.dumps([{"plugin": "scalars", "tag": tag}])})
    for tag, by_run in index["images"]["tagRunSampledInfo"].items():
        for run in by_run:
            answer = client.get("/data/plugin/timeseries/timeSeries",
                                form={"requests": json.dumps([{"plugin": "images", "tag": tag, "run": run,
                                                                "sample": 0}])})
            series = answer[0].get("runToSeries", {}).get(run, [])
            if series:
                client.get("/data/plugin/timeseries/imageData", {"imageId": series[-1]["imageId"]}, raw=True)
    return _summary(client, first)


def images_dashboard(client: Client) -> dict:
    first = len(client.log)
    index = client.get("/data/plugin/images/tags")
    for run, tags in index.items():
        for tag in tags:
            entries = client.get("/data/plugin/images/images", {"run": run, "tag": tag, "sample": 0})
            if entries:
                client.get("/data/plugin/images/individualImage?" + entries[-1]["query"], raw=True)
    return _summary(client, first)


def _chart_filter(chart: dict) -> str:
    """The `tag` parameter the custom-scalars page sends for a chart (its `_tagFilter`)."""
    if "multiline" in chart:
        regexes = chart["multiline"].get("tag", [])
        return regexes[0] if len(regexes) == 1 else "|".join(f"({r})" for r in regexes)
    series = chart.get("margin", {}).get("series", [])
    return "|".join("(" + re.sub(r"[.*+?^${}()|\[\]\\]", lambda m: "\\" + m.group(0), tag) + ")"
                    for s in series for tag in (s["value"], s["lower"], s["upper"]))


def custom_scalars_dashboard(client: Client, runs: list[str]) -> dict:
    first = len(client.log)
    layout = client.get("/data/plugin/custom_scalars/layout")
    open_s, charts, by_category = 0.0, 0, {}
    for category in layout.get("category", []):
        before = len(client.log)
        for chart in category.get("chart", []):
            charts += 1
            for run in runs:
                client.get("/data/plugin/custom_scalars/scalars", {"run": run, "tag": _chart_filter(chart)})
        seconds = sum(r["s"] for r in client.log[before:])
        by_category[category["title"]] = {"charts": len(category.get("chart", [])), "s": round(seconds, 3),
                                          "open": not category.get("closed")}
        open_s += 0.0 if category.get("closed") else seconds
    out = _summary(client, first)
    out.update(charts=charts, categories=len(by_category), open_only_s=round(client.log[first]["s"] + open_s, 3),
               by_category=by_category)
    return out


def text_dashboard(client: Client) -> dict:
    first = len(client.log)
    index = client.get("/data/plugin/text/tags")
    for run, tags in index.items():
        for tag in tags:
            client.get("/data/plugin/text/text", {"run": run, "tag": tag})
    return _summary(client, first)


# the first group's cards in view: each with its chart's axes and the values of its runs (not the spinner)
_CARDS_IN_VIEW = ("[...(document.querySelector('metrics-card-grid') || document.createElement('b'))"
                  ".querySelectorAll('card-view')].filter(c => c.getBoundingClientRect().top < innerHeight)")
_CARDS_SHOWN = (f"(() => {{ const cards = {_CARDS_IN_VIEW}; return cards.length > 0 && cards.every(c =>"
                " c.querySelector('line-chart canvas') && c.querySelector('scalar-card-data-table tb-data-table-content-row')"
                " && !c.querySelector('mat-spinner')); })()")
_CHART_BOXES = (f"{_CARDS_IN_VIEW}.map(c => {{ const r = c.querySelector('line-chart').getBoundingClientRect();"
                " return [r.left, r.top, r.right, r.bottom].map(Math.round); })")
_RUN_COLOURS = ("[...document.querySelectorAll('runs-data-table .run-color-swatch')]"
                ".map(s => s.style.background.match(/\\d+/g).slice(0, 3).map(Number))")


def first_screen(base: str, loads: int) -> dict:
    """Seconds until a fresh browser shows the first screen of Time Series (module docstring, 4.)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import numpy as np
    from cdp import Browser
    executable, why = Browser.find()
    if executable is None:
        return {"first_screen": f"skipped: {why}"}
    shown, lines = [], []
    for _ in range(loads):
        profile = tempfile.TemporaryDirectory(prefix="tbview-browser-")  # a first visit: nothing cached
        browser = Browser(executable, Path(profile.name))
        try:
            browser.viewport(1600, 1000)
            started = time.perf_counter()
            browser.call("Page.navigate", url=f"{base}/#timeseries")
            browser.wait_for(_CARDS_SHOWN, 120)
            shown.append(time.perf_counter() - started)
            colours = np.array(browser.evaluate(_RUN_COLOURS))
            while time.perf_counter() - started < 120:
                page = browser.screenshot().astype(int)
                charts = [page[top:bottom, left:right] for left, top, right, bottom in browser.evaluate(_CHART_BOXES)]
                if all((np.abs(chart[:, :, None, :] - colours).max(axis=3) <= 12).any(axis=2).sum() >= 20
                       for chart in charts):
                    lines.append(time.perf_counter() - started)
                    break
                time.sleep(0.1)
        finally:
            browser.close()
            profile.cleanup()
    return {"first_screen_s": [round(s, 2) for s in shown], "first_lines_s": [round(s, 2) for s in lines]}


def measure(logdir: Path, reload: str, last_step: int | None, timeout: float, first_screen_loads: int = 0) -> dict:
    port = free_port()
    started = time.perf_counter()
    process = start_tensorboard(logdir, port, reload)
    try:
        client = Client(port)
        load_s = wait_loaded(process, client, reload, last_step, timeout)
        load_cpu = _cpu_s(process.pid)
        screen = first_screen(client.base, first_screen_loads) if first_screen_loads else {}
        runs = sorted(client.get("/data/runs"))
        scalar_tags, image_tags, text_tags = _tag_counts(client)
        dashboards = {"scalars": scalars_dashboard(client), "time_series": time_series_dashboard(client),
                      "images": images_dashboard(client), "custom_scalars": custom_scalars_dashboard(client, runs),
                      "text": text_dashboard(client)}
        return {"tensorboard_load_s": round(load_s, 1), "tensorboard_load_cpu_s": round(load_cpu, 1),
                "tensorboard_rss_mb": _rss_mb(process.pid), "runs": runs, "scalar_tags": scalar_tags,
                "image_tags": image_tags, "text_tags": text_tags, **screen, "dashboards": dashboards,
                "served_for_s": round(time.perf_counter() - started, 1)}
    finally:
        stop(process)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="the run directory (rank_*/monitor.db); generated when missing")
    parser.add_argument("--logdir", help="where `trainmon watch --once` writes the view (default: RUN-tbview, "
                                         "beside RUN; rewritten unless --no-watch)")
    parser.add_argument("--no-watch", action="store_true", help="measure the view already in --logdir")
    parser.add_argument("--ranks", type=int, default=256, help="generating: ranks (default 256)")
    parser.add_argument("--steps", type=int, default=1000, help="generating: steps (default 1000)")
    parser.add_argument("--watch-args", default="", metavar="ARGS",
                        help="more arguments of `trainmon watch`, e.g. \"--detail 'layers\\.3\\.' --ranks 0\"")
    parser.add_argument("--reload", choices=["blocking", "thread"], default="blocking",
                        help="TensorBoard's loading: all before serving (default), or its default thread")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds TensorBoard may take to load")
    parser.add_argument("--first-screen", type=int, default=0, metavar="N",
                        help="open Time Series N times in headless Chromium and time its first screen")
    parser.add_argument("--json", metavar="FILE", help="also write the summary here")
    args = parser.parse_args()
    run = Path(args.run).resolve()
    logdir = Path(args.logdir).resolve() if args.logdir else run.parent / f"{run.name}-tbview"
    out: dict = {"run": str(run), "logdir": str(logdir), "load_average_start": os.getloadavg()[0]}
    if not run.exists():
        out["generate_s"] = round(generate(run, args.ranks, args.steps), 1)
    out["ranks"] = len(list(run.glob("rank_*")))
    if not args.no_watch:
        out["watch_args"] = shlex.split(args.watch_args)
        out["watch_once_wall_s"] = round(watch_once(run, logdir, out["watch_args"]), 1)
    out.update(sizes(run, logdir))
    state = logdir / "watch_state.json"
    last_step = None
    if state.exists():
        last_step = json.loads(state.read_text()).get("exported")
    out["last_step"] = last_step
    out["reload"] = args.reload
    out.update(measure(logdir, args.reload, last_step, args.timeout, args.first_screen))
    out["load_average_end"] = os.getloadavg()[0]
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
