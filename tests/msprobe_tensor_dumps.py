"""Small msprobe tensor dumps (`task: tensor`, level L1) for the tests, in msprobe's layout.

msprobe writes `<dump_path>/step<S>/rank<R>/dump.json`, `stack.json` and `dump_tensor_data/<data_name>`,
one `.pt` file per tensor, named `{api_type}.{api_name}.{call_count}.{forward|backward}.{input|output}.{i}.pt`;
each tensor of dump.json names its file in `data_name` and carries Max/Min/Mean/Norm. Written here with
torch alone (tests/data/msprobe/make_dumps.py needs msprobe itself): two linear calls and a relu, per rank.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch


def _tensor(directory: Path, data_name: str, t: torch.Tensor) -> dict:
    torch.save(t.clone(), directory / data_name)
    return {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "Max": float(t.max()),
            "Min": float(t.min()), "Mean": float(t.mean()), "Norm": float(t.norm()), "requires_grad": False,
            "data_name": data_name}


def write_msprobe_tensor_dump(dump_path: Path, perturb: Optional[str], ranks: int = 2) -> None:
    """One step of a two-layer forward per rank; `perturb` names the API call whose output is changed."""
    for rank in range(ranks):
        rank_dir = dump_path / "step0" / f"rank{rank}"
        data_dir = rank_dir / "dump_tensor_data"
        data_dir.mkdir(parents=True)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(4, 8, generator=gen)
        w1, w2 = torch.randn(8, 8, generator=gen), torch.randn(2, 8, generator=gen)
        entries, stacks = {}, {}
        calls = (("Functional.linear.0", lambda v: torch.nn.functional.linear(v, w1), [w1]),
                 ("Functional.relu.0", torch.relu, []),
                 ("Functional.linear.1", lambda v: torch.nn.functional.linear(v, w2), [w2]))
        for i, (call, fn, weights) in enumerate(calls):
            out = fn(x)
            if call == perturb:
                out = out + torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
            name = f"{call}.forward"
            entries[name] = {
                "input_args": [_tensor(data_dir, f"{name}.input.{j}.pt", t) for j, t in enumerate([x] + weights)],
                "input_kwargs": {},
                "output": [_tensor(data_dir, f"{name}.output.0.pt", out)],
            }
            stacks[str(i)] = [[name], [f"File /work/model.py, line {10 + i}, in forward, {call}(x)"]]
            x = out
        (rank_dir / "dump.json").write_text(json.dumps({"task": "tensor", "level": "L1", "framework": "pytorch",
                                                        "dump_data_dir": str(data_dir), "data": entries}))
        (rank_dir / "stack.json").write_text(json.dumps(stacks))
