"""The `sat` op, `trainmon overflow` (computed here / inherited / internal) and loss-scale events."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from trainmon import TrainerMon, open_run
from trainmon.cli import main
from trainmon.engine import stats

FP16_MAX = torch.finfo(torch.float16).max  # 65504


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sat_equals_a_direct_count(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 1000, generator=gen) * torch.finfo(dtype).max / 3).to(dtype)
    x[0, :4] = torch.finfo(dtype).max
    x[1, :2] = float("inf")
    x[2, :2] = float("nan")
    small = torch.ones(5, dtype=dtype)  # on CPU, with min and max known, no pass counts it
    for ops in (["sat", "norm"], ["sat", "min", "max"]):
        for sat_dtype, threshold in ((None, None), (torch.float16, None), (None, 1e3)):
            fields = stats.fields_for_ops(ops, threshold, sat_dtype)
            limit = fields.sat_limit(dtype)
            expected = int((x.isfinite() & (x.abs() >= limit)).sum())
            got = stats.tensor_records([x, small, x.t()], 1e-8, fields)[:, stats.FIELDS.index("sat")]
            assert got.tolist() == [expected, 0, expected], (dtype, ops, sat_dtype, threshold)
    assert stats.fields_for_ops(["sat"], sat_dtype=torch.float16).sat_limit(torch.float32) == FP16_MAX


class Scale(nn.Module):
    def forward(self, x):
        return x * 1.0


class Net(nn.Module):
    """embed (identity) -> big (a matmul that reaches 65504 on inputs of ones) -> after -> head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8, bias=False)
        self.big = nn.Linear(8, 8, bias=False)
        self.after = Scale()
        self.head = nn.Linear(8, 1, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(torch.eye(8))
            self.big.weight.fill_(0.01)
            self.head.weight.fill_(1e-4)

    def forward(self, x):
        return self.head(self.after(self.big(self.embed(x))))


def run(tmp_path, monkeypatch, before_step, data=lambda step: torch.ones(2, 8), steps=2, scaler=None, model=None):
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"xy_distribution": True, "ops": ["norm", "nans", "infs", "sat"],
                                  "format": ["db"], "strict": True}))
    model = model or Net().half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = TrainerMon(str(config)).set_monitor(model, optimizer)
    for step in range(steps):
        before_step(model, step)
        loss = model(data(step).to(next(model.parameters()).dtype)).float().sum()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
    monitor.stop()
    return next(out.iterdir())


def overflow(capsys, path):
    code = main(["overflow", str(path), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == (1 if result["modules"] else 0)  # 1 found, 0 clean
    return result


def test_fp16_saturation_computed_here_then_inherited(tmp_path, monkeypatch, capsys):
    def saturate(model, step):
        if step == 1:
            with torch.no_grad():
                model.big.weight.fill_(FP16_MAX / 8)  # 8 ones times 8188: exactly 65504

    path = run(tmp_path, monkeypatch, saturate)
    result = overflow(capsys, path)
    first, then = result["modules"][0], result["modules"][1]
    assert (first["module"], first["class"], first["step"], first["phase"]) == ("big", "computed here", 1, "forward")
    assert "saturated" in first["what"] and first["next"]
    assert (then["module"], then["class"], then["origin"]) == ("after", "inherited", "big")
    assert main(["overflow", str(path)]) == 1
    text = capsys.readouterr().out
    assert "big output" in text and "computed here" in text and "next:" in text


def test_inf_in_the_data_is_inherited_from_the_data(tmp_path, monkeypatch, capsys):
    def data(step):
        x = torch.ones(2, 8)
        if step == 1:
            x[0, 3] = float("inf")
        return x

    path = run(tmp_path, monkeypatch, lambda model, step: None, data=data)
    first = overflow(capsys, path)["modules"][0]
    assert (first["module"], first["tensor"], first["class"], first["origin"], first["step"]) == \
        ("", "input", "inherited", "data", 1)
    assert "data" in first["next"]
    # nan-analyze's report carries the same classification
    assert main(["nan-analyze", str(path), "--quiet", "--json", "--overflow"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["overflow"]["modules"][0]["origin"] == "data"


def test_a_skipped_grad_scaler_step_is_recorded(tmp_path, monkeypatch, capsys):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_interval=1000)
    # grads of the order of 1e3 times the scale: past fp32's range until the scale has backed off
    path = run(tmp_path, monkeypatch, lambda model, step: None, data=lambda step: torch.full((2, 8), 1e4), steps=3,
               scaler=scaler, model=Net())
    assert torch.amp.GradScaler.update.__qualname__ == "GradScaler.update", "stop() restores GradScaler.update"
    with open_run(path) as monitor_run:
        scalars = monitor_run.scalars()
    last = scalars.sort_values("step").groupby("name")["value"].last()
    assert last["amp_updates"] == 3 and last["amp_skipped_steps"] >= 1
    assert last["loss_scale"] < 2.0 ** 127
    scale = overflow(capsys, path)["loss_scale"]
    assert scale["skipped"] >= 1 and scale["updates"] == 3 and 0 < scale["rate"] <= 1


class HugeGrad(torch.autograd.Function):
    """Identity forward; a backward that overflows fp16."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e30


class Internal(nn.Module):
    def forward(self, x):
        return HugeGrad.apply(x)


def test_clean_forward_and_bad_grads_are_internal(tmp_path, monkeypatch, capsys):
    model = Net().half()
    model.after = Internal()
    path = run(tmp_path, monkeypatch, lambda model, step: None, steps=1, model=model)
    first = overflow(capsys, path)["modules"][0]
    assert first["class"] == "internal" and first["phase"] == "backward" and "fp32" in first["next"]


class MegatronScaler:
    def __init__(self):
        self.scale = torch.tensor(1024.0)


class MegatronLikeOptimizer:
    """The attributes trainmon reads of Megatron's mixed-precision optimizer, around a torch optimizer
    (whose own `found_inf` attribute would mean something else to it)."""

    def __init__(self, inner):
        self.inner, self.param_groups, self.state = inner, inner.param_groups, inner.state
        self.grad_scaler, self.found_inf = MegatronScaler(), torch.tensor(0.0)

    def step(self):
        self.inner.step()

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)


@pytest.mark.parametrize("framework", ["deepspeed", "megatron"])
def test_a_framework_loss_scaler_is_read_at_each_step(tmp_path, monkeypatch, framework):
    model = Net().float()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    if framework == "deepspeed":  # what DeepSpeed's fp16 optimizer exposes
        optimizer.cur_scale, optimizer.overflow = 1024.0, False
    else:
        optimizer = MegatronLikeOptimizer(optimizer)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"format": ["db"], "strict": True}))
    monitor = TrainerMon(str(config)).set_monitor(model, optimizer)
    for step in range(2):
        optimizer.overflow = step == 1
        if framework == "megatron":
            optimizer.found_inf = torch.tensor(float(step == 1))
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
    monitor.stop()
    with open_run(next((tmp_path / "out").iterdir())) as monitor_run:
        scalars = monitor_run.scalars()
    by_name = scalars.groupby("name")["value"].last()
    assert by_name["loss_scale"] == 1024.0 and by_name["amp_skipped_steps"] == 1 and by_name["amp_updates"] == 2
