"""The package's floors: every import points down (or stays in its own part), and the ground floor imports
nothing else from trainmon.

Floors, bottom to top; a part may import its own modules and those of lower floors only:
  core: shared facts (record schema, records, anomaly event, ordering key, run layout)
  engine: the statistic engine (records of tensors on their device, the accelerators' slot table)
  monitor: hooks, adapters, config
  writers: the writer thread and sinks
  read: the one read layer
  anomaly: rules, the online processor, post-mortem analysis
  compare, config_check, output_dir / ckpt, watch, tb_plugin, conversions, export: tools over runs
  hook_table / trainer_mon: the wiring / integrations (training loops that attach it), demo (the demo job)
  commands / cli and the package root: the command line and the public names
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import trainmon

ROOT = Path(trainmon.__file__).parent
FLOORS = (
    {"core"},
    {"engine"},
    {"monitor"},
    {"writers"},
    {"read"},
    {"anomaly"},
    {"compare", "config_check", "output_dir"},
    {"ckpt", "watch", "tb_plugin", "conversions", "export"},
    {"hook_table"},
    {"trainer_mon"},
    {"integrations", "demo"},
    {"commands"},
    {"cli", "__init__"},
)
FLOOR = {part: level for level, parts in enumerate(FLOORS) for part in parts}


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
            if names[0] == "trainmon":  # `from trainmon import x`: x may be a part
                names = [f"trainmon.{a.name}" if (ROOT / a.name).exists() or (ROOT / f"{a.name}.py").exists()
                         else "trainmon" for a in node.names]
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
    assert sorted(name for _, name in _imports(probe, text)) == ["trainmon.core", "trainmon.read",
                                                                   "trainmon.watch"]


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
    assert not found, ("host values copied to a device with a blocking copy; use buffers.host_values (pinned, non-blocking):"
                       "\n" + "\n".join(found))


def test_the_device_copy_check_sees_a_blocking_copy():
    source = "def flush(rows, slots):\n    return torch.tensor(slots, device=rows.device)\n"
    assert list(_tensors_made_on_a_device(source)) == [("flush", 2)]
