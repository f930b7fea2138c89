"""What the structure view shows, read through trainmon's read layer: the runs it offers, the module tree of a run,
each node's records at one step of one rank, the first non-finite tensor and its path (nan-analyze), and where the
run parts from a baseline run (compare: records, and tensor dumps where both runs hold the step's).

A record belongs to a node of the module tree by its name (`node_of`): activations to their module, weights,
grads and optimizer state to the module that holds the parameter, saved variables (`trainmon.save`) to the
module their dotted name starts with (a plain name: the model itself), collectives to `(collectives)`.
Nothing here holds a run open between calls: the plugin caches what it computed.
"""
from __future__ import annotations

import json
import math
import re
import sqlite3
from pathlib import Path

from trainmon.core.records import COMM
from trainmon.core.layout import (ANOMALIES_FILE, DB_NAME, DUMPS_DIR, MODULE_STRUCT_FILE, RANK_DIR, RUN_JSON,
                                   STREAM_NAME, WATCH_STATE_FILE, WATCHED_RUN, dump_step_dir_name)
from trainmon.read.errors import InputError
from trainmon.read.layout import RankDir, RunDirs, find_run
from trainmon.read.rank_records import open_rank
from trainmon.writers.db_schema import NONFINITE_RECORD

ROOT = ""  # the model itself
COLLECTIVES = "(collectives)"
_CALL = re.compile(r"#\d+$")  # `<module>#<k>`: the k-th extra call of a module in one micro-step
# nan-analyze names a record's tensor; these are a module's own (the rest are a parameter's or a saved variable's)
_MODULE_TENSORS = re.compile(r"^(grad_)?(input|output)(_\d+)?$")


def runs_under(logdir: Path, depth: int = 2) -> list[Path]:
    """Run directories (holding `rank_<R>/`) at `logdir` or up to `depth` levels below it, by name."""
    found, level = [], [logdir]
    for _ in range(depth + 1):
        below = []
        for directory in level:
            children = [c for c in _children(directory) if c.is_dir()]
            if any(RANK_DIR.search(c.name) for c in children):
                found.append(directory)
            else:
                below += children
        level = below
    return sorted(found)


def watched_runs(logdir: Path, depth: int = 2) -> list[Path]:
    """The runs whose `trainmon watch` view is at `logdir` or up to `depth` levels below it (the daemon's state file
    names its run), so that `tensorboard --logdir <run>/watch` finds the run it shows."""
    found, level = [], [logdir]
    for _ in range(depth + 1):
        below = []
        for directory in level:
            state = directory / WATCH_STATE_FILE
            if state.is_file():
                try:
                    run = Path(json.loads(state.read_text(encoding="utf-8"))[WATCHED_RUN])
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # not a state file of this version: that view names no run
                if run.is_dir():
                    found.append(run)
            else:
                below += [c for c in _children(directory) if c.is_dir()]
        level = below
    return found


def run_names(logdir: Path) -> dict[str, Path]:
    """{name: directory} of the runs the view offers: the runs under `logdir` by their path below it (the logdir's
    own name when it is a run), then the runs that a `trainmon watch` view under it shows, by their own name (with
    their parent's where two share a name)."""
    out: dict[str, Path] = {}
    seen = set()
    for path in runs_under(logdir):
        out[path.name if path == logdir else path.relative_to(logdir).as_posix()] = path
        seen.add(path.resolve())
    for path in watched_runs(logdir):
        if path.resolve() in seen:
            continue
        seen.add(path.resolve())
        name = path.name if path.name not in out else f"{path.parent.name}/{path.name}"
        out[name] = path
    return out


def _children(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except OSError:
        return []


def node_of(family: str, name: str) -> tuple[str, str]:
    """(node, leaf) of a record: the module tree node it belongs to and what it is there."""
    if family == COMM:
        return COLLECTIVES, name
    node, _, leaf = name.rpartition(".")
    call = _CALL.search(node)
    if call:  # a module's extra call: the module's node, the call in the leaf
        node, leaf = node[:call.start()], f"{call.group()}.{leaf}"
    return node, leaf


def node_of_event(where: dict) -> str:
    """The node of a place named by nan-analyze ({module, tensor, ...})."""
    module, tensor = where["module"], where["tensor"]
    if tensor == COMM:
        return COLLECTIVES
    if _MODULE_TENSORS.match(tensor):
        return _CALL.sub("", module)
    return node_of("", module)[0]  # a parameter or a saved variable: its dotted name's module


def json_number(value):
    """A figure for JSON: NaN and the infinities as strings, so the document stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class RunData:
    """One run's directories and what the view reads of them."""

    def __init__(self, path: Path):
        self.dirs: RunDirs = find_run(path)
        self.path = self.dirs.path
        self._by_rank = {r.rank: r for r in self.dirs.ranks}

    @property
    def ranks(self) -> list[int]:
        return sorted(self._by_rank)

    def rank_dir(self, rank: int) -> RankDir:
        if rank not in self._by_rank:
            raise KeyError(f"{self.path} has no rank {rank}")
        return self._by_rank[rank]

    def stamps(self) -> tuple:
        """What changes when a rank writes more: the modification times of its rank directories and databases."""
        out = []
        for rank_dir in self.dirs.ranks:
            for path in (rank_dir.path / DB_NAME, rank_dir.path / f"{DB_NAME}-wal", rank_dir.path / ANOMALIES_FILE):
                if path.exists():
                    out.append(path.stat().st_mtime_ns)
            out.append(rank_dir.path.stat().st_mtime_ns)
        return tuple(out)

    def modified(self) -> float:
        """When a rank last wrote: the newest modification time of its records and metadata (not of the directory,
        which readers change too, making a database's shared-memory file)."""
        times = [path.stat().st_mtime for rank_dir in self.dirs.ranks
                 for path in (rank_dir.path / name for name in (DB_NAME, STREAM_NAME, RUN_JSON, ANOMALIES_FILE))
                 if path.exists()]
        return max(times, default=0.0)

    def holds_nonfinite(self) -> bool:
        """Whether a rank's database holds a non-finite record (a seek in its partial index per rank, up to the
        first rank holding one; ranks without a database are not looked at)."""
        for rank_dir in self.dirs.ranks:
            try:
                db = rank_dir.db
            except (InputError, OSError):
                continue  # a record stream that cannot be read: the tree and nan-analyze say why
            if db is None:
                continue
            conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                if conn.execute(f"SELECT 1 FROM records WHERE {NONFINITE_RECORD} LIMIT 1").fetchone():
                    return True
            except sqlite3.Error:
                continue  # not readable here: the tree and nan-analyze say why
            finally:
                conn.close()
        return False

    def steps(self, rank: int) -> list[int]:
        """The steps `rank` holds records of (from CSV file names: the steps their ranges span)."""
        rank_dir = self.rank_dir(rank)
        if rank_dir.db is not None:
            conn = sqlite3.connect(f"file:{rank_dir.db}?mode=ro", uri=True)
            try:
                return [s for (s,) in conn.execute("SELECT DISTINCT step FROM records ORDER BY step")]
            finally:
                conn.close()
        return sorted({s for f in rank_dir.family_files() for s in range(f.first, f.last + 1)})

    def records(self, rank: int, step: int) -> tuple[list[str], list[dict]]:
        """(ops, rows) of one rank at one step, rows as the read layer gives them."""
        reader = open_rank(self.rank_dir(rank))
        try:
            rows = [row for _, step_rows in reader.rows(None, step, step) for row in step_rows]
            return list(reader.ops), rows
        finally:
            reader.close()

    def structure(self, rank: int) -> dict:
        """{module name: class} from the rank's `module_struct.json` (`print_struct`), or any rank's; {} without."""
        candidates = [self.rank_dir(rank)] + [r for r in self.dirs.ranks if r.rank != rank][:8]
        for rank_dir in candidates:
            path = rank_dir.path / MODULE_STRUCT_FILE
            if path.is_file():
                return _struct_classes(json.loads(path.read_text(encoding="utf-8")))
        return {}


def _struct_classes(struct: dict) -> dict:
    """`module_structure`'s {"<vpp>:<name>": {class, ...}} as {name as records give it: class}."""
    out = {}
    for key, info in struct.items():
        vpp, _, name = key.partition(":")
        out[name if vpp in ("", "0") else f"{vpp}:{name}"] = info.get("class", "")
    return out


def step_tree(data: RunData, rank: int, step: int) -> dict:
    """The module tree with each node's records at (rank, step).

    Returns:
        {ops, nodes: [{id, parent, label, class, records: [...], nonfinite}]}: parents before children, siblings in
        model order (`module_struct.json`'s; without it, by name with numbers in order); a record
        is {family, leaf, micro_step, <op>: figure}; `nonfinite` counts the node's own records that hold a NaN
        or Inf.
    """
    ops, rows = data.records(rank, step)
    classes = data.structure(rank)
    records: dict[str, list] = {}
    for row in sorted(rows, key=lambda r: (r.get("call_index") is None, r.get("call_index") or 0)):
        node, leaf = node_of(row["family"], row["name"])
        records.setdefault(node, []).append(
            {"family": row["family"], "leaf": leaf, "micro_step": row.get("micro_step"),
             **{op: json_number(row.get(op)) for op in ops}})
    names = {ROOT} | set(classes) | set(records)
    for name in list(names):  # every ancestor is a node
        while name:
            name = _parent(name)
            names.add(name)
    in_model = {name: i for i, name in enumerate(classes)}  # module_struct.json lists them in model order
    nodes = []
    for name in sorted(names, key=lambda n: (n.count(".") + (n != ROOT), in_model.get(n, len(in_model)),
                                             _natural(n))):
        own = records.get(name, [])
        nodes.append({"id": name, "parent": None if name == ROOT else _parent(name),
                      "label": "(model)" if name == ROOT else name.rpartition(".")[2],
                      "class": classes.get(name, ""), "records": own,
                      "nonfinite": sum(_nonfinite(r) for r in own)})
    return {"ops": ops, "nodes": nodes}


def _parent(name: str) -> str:
    return name.rpartition(".")[0] if name != COLLECTIVES else ROOT


def _natural(name: str) -> list:
    """layers.2 before layers.10."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def _nonfinite(record: dict) -> bool:
    for op in ("nans", "infs"):
        value = record.get(op)
        if isinstance(value, (int, float)) and value > 0:
            return True
    return any(isinstance(record.get(op), str) for op in ("norm", "max", "min", "mean"))


def nan_path(run_path: Path) -> dict:
    """nan-analyze's first non-finite tensor and its path, each place with its tree node."""
    from trainmon.analysis.nan_analyze import analyze

    report = analyze(run_path)
    first = report["first"]
    return {"first": None if first is None else {**first, "node": node_of_event(first)},
            "first_record": report["first_record"],
            "chain": [{**c, "node": node_of_event(c)} for c in report["chain"]],
            "ties": report["ties"], "nonfinite_records": report["nonfinite_records"]}


def comparison(run: RunData, baseline: RunData, rank: int, step: int) -> dict:
    """Where `run` parts from `baseline` on `rank`: the first divergent record of all steps, and per node
    at `step` the largest relative difference of its records (and, where both runs dumped that step's
    tensors, the lowest cosine and the largest absolute error). The steps are screened all at once
    (`divergent_steps`); only those that may diverge, and `step`, are judged record by record."""
    from trainmon.compare.records import DIVERGED, align, divergent_steps, execution_order
    from trainmon.compare.report import describe
    from trainmon.read import open_run

    first = None
    # each run opened at its rank's directory: the other ranks are not read (a thousand of them cost seconds)
    with open_run(baseline.rank_dir(rank).path) as run_a, open_run(run.rank_dir(rank).path) as run_b:
        for candidate in divergent_steps(run_a, run_b, rank):
            judged = execution_order(list(align(run_a, run_b, [rank], (candidate, candidate))))
            first = next((r for r in judged if r.verdict == DIVERGED), None)
            if first is not None:
                break
        records = list(align(run_a, run_b, [rank], (step, step)))
    nodes: dict[str, dict] = {}
    for record in records:
        node = nodes.setdefault(node_of(record.family, record.name)[0], {"max_rel": 0.0, "diverged": 0})
        node["max_rel"] = max(node["max_rel"], record.worst)
        node["diverged"] += record.verdict == DIVERGED
    for node, figures in _dump_figures(run, baseline, rank, step).items():
        nodes.setdefault(node, {"max_rel": 0.0, "diverged": 0}).update(figures)
    first_json = None
    if first is not None:
        first_json = {**describe(first), "node": node_of(first.family, first.name)[0]}
    return {"baseline": str(baseline.path), "first_divergent": first_json,
            "nodes": {n: {k: json_number(v) for k, v in f.items()} for n, f in nodes.items()}}


def _dump_figures(run: RunData, baseline: RunData, rank: int, step: int) -> dict:
    """{node: {cosine, max_abs, nonfinite_mismatch}} of the tensors both runs dumped at (rank, step) (cosine and
    max_abs over the elements finite in both); {} where one run has none."""
    directories = [side.rank_dir(rank).path / DUMPS_DIR for side in (baseline, run)]
    if not all((directory / dump_step_dir_name(step)).is_dir() for directory in directories):
        return {}
    from trainmon.compare.dumps import read_dumps  # torch: imported only where there are tensors to compare
    from trainmon.compare.tensors import DEFAULT_COSINE, DEFAULT_MAX_ABS, compare_step

    dumps = []
    for directory in directories:
        try:
            dumps.append(read_dumps(directory).get((rank, step)))
        except InputError:
            return {}
    if None in dumps:
        return {}
    out: dict[str, dict] = {}
    for row in compare_step(dumps[0], dumps[1], 1e-3, 1e-6, DEFAULT_COSINE, DEFAULT_MAX_ABS):
        if "cosine" not in row:
            continue
        node = out.setdefault(node_of_event({"module": row["module"], "tensor": row["role"]}),
                              {"cosine": 1.0, "max_abs": 0.0, "nonfinite_mismatch": 0})
        node["cosine"] = min(node["cosine"], row["cosine"])
        node["max_abs"] = max(node["max_abs"], row["max_abs"])
        node["nonfinite_mismatch"] += row["nonfinite_mismatch"]
    return out
