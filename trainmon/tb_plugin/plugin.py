"""The TensorBoard plugin of the structure view: TensorBoard loads it through the `tensorboard_plugins` entry
point and serves its page (plain JS and CSS of this package, nothing from the network) in the "trainmon"
tab, next to the scalars that `tensorboard --logdir monitor_output` shows.

Routes, under TensorBoard's `/data/plugin/trainmon/`:
- `index.js`, `style.css`: the page;
- `runs`: the runs under the logdir and those its `trainmon watch` views show (`data.run_names`), each with its
  ranks and whether it holds a non-finite record, and the run to open: the newest holding one, else the newest;
- `steps?run=&rank=`: the steps a rank holds;
- `tree?run=&rank=&step=`: the module tree with each node's records (`data.step_tree`);
- `nan?run=`: the first non-finite tensor and its path (nan-analyze, computed once per state of the run);
- `compare?run=&baseline=&rank=&step=`: where the run parts from a baseline run (`data.comparison`).
Errors come back as JSON {error} with status 400 (a bad argument) or 500 (an unreadable run).
"""
from __future__ import annotations

import collections
import json
import logging
import threading
from importlib import resources
from pathlib import Path

from werkzeug import wrappers

from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin

from trainmon.read import InputError
from trainmon.tb_plugin import data

logger = logging.getLogger("trainmon")
PLUGIN_NAME = "trainmon"
_STATIC = {"/index.js": "application/javascript", "/style.css": "text/css"}


class _Cache:
    """The last results of expensive reads, keyed by their arguments and the run's state on disk."""

    def __init__(self, size: int = 8):
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key, compute):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = compute()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return value


class _BadRequest(Exception):
    pass


class StructurePlugin(base_plugin.TBPlugin):
    """The module tree of a trainmon run with per-node figures, non-finite and divergent nodes."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context):
        self._logdir = Path(context.logdir) if context.logdir else None
        self._cache = _Cache()
        self._nonfinite = _Cache(64)  # per run: whether it holds a NaN/Inf, until a rank writes more

    def is_active(self) -> bool:
        return bool(self._run_names())

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="trainmon structure")

    def get_plugin_apps(self):
        apps = {route: self._static(route, kind) for route, kind in _STATIC.items()}
        apps.update({"/runs": self._json(self._runs), "/steps": self._json(self._steps),
                     "/tree": self._json(self._tree), "/nan": self._json(self._nan),
                     "/compare": self._json(self._compare)})
        return apps

    # ------------------------------------------------------------------------------------------ routes
    @staticmethod
    def _static(route: str, kind: str):
        body = resources.files("trainmon.tb_plugin").joinpath("static", route.lstrip("/")).read_bytes()

        @wrappers.Request.application
        def serve(request):
            return http_util.Respond(request, body, kind)

        return serve

    def _json(self, handler):
        @wrappers.Request.application
        def serve(request):
            try:
                payload, code = handler(request.args), 200
            except _BadRequest as err:
                payload, code = {"error": str(err)}, 400
            except (InputError, OSError, ValueError, KeyError) as err:
                logger.warning("trainmon structure view: %s", err)
                payload, code = {"error": str(err)}, 500
            return http_util.Respond(request, json.dumps(payload, default=str), "application/json", code=code)

        return serve

    def _runs(self, args) -> dict:
        runs = []
        for name, path in sorted(self._run_names().items()):
            try:
                run = data.RunData(path)
                stamps = run.stamps()
            except (InputError, OSError) as err:
                logger.warning("trainmon structure view: %s", err)
                continue
            nonfinite = self._nonfinite.get((str(run.path), stamps), run.holds_nonfinite)
            runs.append({"run": name, "ranks": run.ranks, "nonfinite": nonfinite, "modified": run.modified()})
        # the newest run holding a NaN/Inf: a clean run made after a failure must not hide it
        newest = sorted(runs, key=lambda r: (r["nonfinite"], r["modified"]))
        return {"runs": runs, "open": newest[-1]["run"] if newest else None}

    def _steps(self, args) -> dict:
        run = self._run(args, "run")
        return {"steps": run.steps(self._int(args, "rank"))}

    def _tree(self, args) -> dict:
        run, rank, step = self._run(args, "run"), self._int(args, "rank"), self._int(args, "step")
        key = ("tree", str(run.path), rank, step, run.stamps())
        return self._cache.get(key, lambda: data.step_tree(run, rank, step))

    def _nan(self, args) -> dict:
        run = self._run(args, "run")
        return self._cache.get(("nan", str(run.path), run.stamps()), lambda: data.nan_path(run.path))

    def _compare(self, args) -> dict:
        run, baseline = self._run(args, "run"), self._run(args, "baseline")
        rank, step = self._int(args, "rank"), self._int(args, "step")
        key = ("compare", str(run.path), str(baseline.path), rank, step, run.stamps(), baseline.stamps())
        return self._cache.get(key, lambda: data.comparison(run, baseline, rank, step))

    # ---------------------------------------------------------------------------------------- arguments
    def _run_names(self) -> dict[str, Path]:
        return data.run_names(self._logdir) if self._logdir is not None else {}

    def _run(self, args, key: str) -> data.RunData:
        """The run named by argument `key`: one that /runs lists (never another directory)."""
        name = args.get(key)
        if not name or self._logdir is None:
            raise _BadRequest(f"give `{key}`: one of the runs that /runs lists")
        path = self._run_names().get(name)
        if path is None:
            raise _BadRequest(f"{key} {name!r} is not a run that /runs lists")
        return data.RunData(path)

    @staticmethod
    def _int(args, key: str) -> int:
        try:
            return int(args.get(key, ""))
        except ValueError:
            raise _BadRequest(f"give `{key}` as a whole number, got {args.get(key)!r}") from None
