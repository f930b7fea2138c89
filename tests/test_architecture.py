"""The package's floors: every import points down (or stays in its own part), and the ground floor imports
nothing else from trainmon.

Floors, bottom to top; a part may import its own modules and those of lower floors only:
  core: shared facts (record schema, records, anomaly event, ordering key, run layout)
  engine / config / adapters: the statistic engine (records of tensors on their device, the accelerators' slot
    table) / the monitor's configuration / the framework adapters
  hooks: the hooks on a training job and the step collector
  writers: the writer thread and sinks
  read: the one read layer
  anomaly / analysis: the rules and the online processor / post-mortem analysis of a run's files
  compare, config_check, output_dir / ckpt, watch, tb_plugin, conversions, export: tools over runs
  hook_table / trainer_mon: the wiring / integrations (training loops that attach it), demo (the demo job)
  commands / cli and the package root: the command line and the public names

An import named by a string (a registry of modules imported later) counts as an import. Inside a package whose
modules build on each other, INNER_FLOORS orders them the same way. No import circle anywhere, lazy imports
included. Each check is shown failing once on a made-up source.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import trainmon

ROOT = Path(trainmon.__file__).parent
FLOORS = (
    {"core"},
    {"engine", "config", "adapters"},
    {"hooks"},
    {"writers"},
    {"read"},
    {"anomaly", "analysis"},
    {"compare", "config_check", "output_dir"},
    {"ckpt", "watch", "tb_plugin", "conversions", "export"},
    {"hook_table"},
    {"trainer_mon"},
    {"integrations", "demo"},
    {"commands"},
    {"cli", "__init__"},
)
FLOOR = {part: level for level, parts in enumerate(FLOORS) for part in parts}


# A string that names a trainmon module (and maybe an attribute of it), as a registry of what to import later does.
_NAMED_MODULE = re.compile(r"^trainmon(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?$")


# Modules named by a string to be run as a process of their own (`python -m ...`), not imported.
PROCESS_ENTRY_POINTS = {("trainmon.watch.spawn", "trainmon.cli")}


def _exists(module: str) -> bool:
    """Whether `trainmon.a.b` is a module or a package of trainmon."""
    path = ROOT.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _part(module: str) -> str:
    """trainmon.<part>[.…] -> part; the package root is "__init__"."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "__init__"


def _imports(path: Path, text: str | None = None):
    """(line, imported trainmon module) of every import in a file (or in `text`, as if it were that file), at
    any depth: lazy imports count too."""
    module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
            if names[0] == "trainmon" or names[0].startswith("trainmon."):  # `from trainmon.p import x`: x may be
                names = [f"{names[0]}.{a.name}" if _exists(f"{names[0]}.{a.name}") else names[0]  # a module of p
                         for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAMED_MODULE.match(node.value) \
                and _exists(node.value.split(":")[0]) and (_module(path), node.value) not in PROCESS_ENTRY_POINTS:
            names = [node.value.split(":")[0]]      # a module named by a string, imported later by name
        else:
            continue
        for name in names:
            if name == "trainmon" or name.startswith("trainmon."):
                yield node.lineno, name


def _sources():
    return sorted(p for p in ROOT.rglob("*.py") if "tb_plugin/static" not in str(p))


def test_every_part_has_a_floor():
    parts = {_part(".".join(p.relative_to(ROOT.parent).with_suffix("").parts)) for p in _sources()}
    assert parts - set(FLOOR) == set(), "give the new part a floor in FLOORS"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    here = _part(".".join(path.relative_to(ROOT.parent).with_suffix("").parts))
    upward = [f"line {line}: {name} ({_part(name)}, floor {FLOOR[_part(name)]})"
              for line, name in _imports(path)
              if _part(name) != here and FLOOR[_part(name)] >= FLOOR[here]]
    assert not upward, f"{path.relative_to(ROOT)} (floor {FLOOR[here]}) imports from the same or a higher floor:\n" \
                       + "\n".join(upward)


def test_the_check_sees_lazy_and_relative_imports():
    probe = ROOT / "core" / "probe.py"
    text = "def f():\n    from trainmon.watch import spawn\nfrom ..read import layout\nfrom . import schema\n"
    assert sorted(name for _, name in _imports(probe, text)) == ["trainmon.core.schema", "trainmon.read.layout",
                                                                   "trainmon.watch.spawn"]


def test_the_check_sees_a_module_named_by_a_string():
    probe = ROOT / "core" / "probe.py"
    text = 'SINKS = {"csv": "trainmon.writers.csv_sink:CsvSink"}\nNOTE = "trainmon is a monitor"\n'
    assert [name for _, name in _imports(probe, text)] == ["trainmon.writers.csv_sink"]
    assert _upward(probe, text) == ["line 1: trainmon.writers.csv_sink (writers, floor 3)"]


def _upward(path: Path, text: str | None = None) -> list[str]:
    here = _part(_module(path))
    return [f"line {line}: {name} ({_part(name)}, floor {FLOOR[_part(name)]})"
            for line, name in _imports(path, text)
            if _part(name) != here and FLOOR[_part(name)] >= FLOOR[here]]


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)


# Floors inside a package, bottom to top, for packages whose modules build on each other.
INNER_FLOORS = {
    "config": ({"keys", "output", "schedule"}, {"settings"}, {"dynamic"}),
    "adapters": ({"base", "naming", "patching", "unwrap"}, {"ddp", "deepspeed_moe", "fsdp2", "megatron_model"},
                 {"deepspeed", "megatron", "megatron_torch"}),
    "engine": ({"buffers", "fold_kernels", "accelerator", "paths"}, {"stat_kernels"}, {"stats_fused"}, {"stats_native"},
               {"stats_cpu"}, {"stats"}, {"folding"}, {"slot_table", "records"}),
}


def _inner_upward(path: Path, text: str | None = None) -> list[str]:
    """Imports of a module of a package with INNER_FLOORS that point to its own or a higher floor there."""
    names = _module(path).split(".")
    floors = INNER_FLOORS.get(names[1]) if len(names) > 2 else None
    if floors is None:
        return []
    floor = {module: level for level, modules in enumerate(floors) for module in modules}
    floor["__init__"] = len(floors)  # a package's own module is above all of its modules
    here = names[2]
    out = []
    for line, name in _imports(path, text):
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == names[1] and parts[2] != here and floor[parts[2]] >= floor[here]:
            out.append(f"line {line}: {name} (floor {floor[parts[2]]} of {names[1]}, this module's {floor[here]})")
    return out


def test_every_module_of_a_package_with_inner_floors_has_one():
    for package, floors in INNER_FLOORS.items():
        modules = {p.stem for p in (ROOT / package).glob("*.py") if p.stem != "__init__"}
        assert modules == set().union(*floors), f"give the new module of {package} a floor in INNER_FLOORS"


@pytest.mark.parametrize("path", [p for p in _sources() if _module(p).split(".")[1] in INNER_FLOORS],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_inside_a_package_point_down(path):
    upward = _inner_upward(path)
    assert not upward, f"{path.relative_to(ROOT)} imports from its package's same or a higher floor:\n" + \
        "\n".join(upward)


def test_the_inner_check_sees_an_upward_import():
    probe = ROOT / "engine" / "buffers.py"
    assert _inner_upward(probe, "from trainmon.engine import stats\n") == \
        ["line 1: trainmon.engine.stats (floor 5 of engine, this module's 0)"]


def _module_graph(texts: dict | None = None) -> dict[str, set[str]]:
    """Module -> the trainmon modules it imports; `texts` stands in for the sources of some paths."""
    sources = {_module(p).removesuffix(".__init__"): p for p in _sources()}
    for path in texts or {}:
        sources.setdefault(_module(path).removesuffix(".__init__"), path)

    def resolve(name: str) -> str:
        while name not in sources and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph = {}
    for module, path in sources.items():
        edges = {resolve(name) for _, name in _imports(path, (texts or {}).get(path))}
        edges.discard(module)
        graph[module] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: its strongly connected parts of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.get(module, ()):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            part = []
            while not part or part[-1] != module:
                part.append(stack.pop())
                on_stack.discard(part[-1])
            if len(part) > 1:
                found.append(sorted(part))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_circle_anywhere():
    assert _circles(_module_graph()) == []


def test_the_circle_check_sees_a_circle():
    probe = ROOT / "engine" / "buffers.py"
    text = probe.read_text() + "\ndef later():\n    from trainmon.engine import stats\n"
    assert ["trainmon.engine.buffers", "trainmon.engine.stats"] in [
        [m for m in circle if m in ("trainmon.engine.buffers", "trainmon.engine.stats")]
        for circle in _circles(_module_graph({probe: text}))]


# Where a host list may become a device tensor directly: the engine's pinned, non-blocking copy of small
# metadata, and the kernels' thresholds and compile samples (once per run).
HOST_TO_DEVICE = {("engine/buffers.py", "host_values"), ("engine/stat_kernels.py", "_constant"),
                  ("engine/stat_kernels.py", "_sample")}


def _tensors_made_on_a_device(source: str):
    """(function, line) of each `torch.tensor(...)` / `torch.as_tensor(...)` given a `device=`."""
    tree = ast.parse(source)
    owner = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                owner[id(sub)] = node.name          # the innermost function wins: ast.walk goes outside in
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.tensor", "torch.as_tensor")
                and any(k.arg == "device" for k in node.keywords)):
            yield owner.get(id(node)), node.lineno


def test_host_values_reach_a_device_only_through_a_copy_that_does_not_block():
    """`torch.tensor(values, device=...)` copies from pageable host memory, which blocks the training thread
    on an accelerator until the copy is done (found on a GPU: a host sync per flush of the activations)."""
    found = [f"{path.relative_to(ROOT)}:{line} in {function}()"
             for path in _sources() for function, line in _tensors_made_on_a_device(path.read_text())
             if (str(path.relative_to(ROOT)), function) not in HOST_TO_DEVICE]
    assert not found, ("host values copied to a device with a blocking copy; use buffers.host_values (pinned, "
                       "non-blocking):\n" + "\n".join(found))


def test_the_device_copy_check_sees_a_blocking_copy():
    source = "def flush(rows, slots):\n    return torch.tensor(slots, device=rows.device)\n"
    assert list(_tensors_made_on_a_device(source)) == [("flush", 2)]
