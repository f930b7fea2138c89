"""An all-+Inf, a -Inf, a mixed ±Inf and a NaN forward output at a known module and step: the online line,
anomalies.jsonl, the anomalies table, nan-analyze and `trainmon overflow` say which (Inf is not NaN) and
name one call index for the tensor, as do the sentinel's probe and the statistic record."""
import json
import logging
import math
import sqlite3

import pytest
import torch

from test_anomaly_online import STATS, Clock, nan_analyze_json
from training import DEVICES, make_model, run_steps
from trainmon import TrainerMon
from trainmon.cli import main as cli_main

MODULE, STEP = "layers.1.mlp.0", 1


def _all_pos_inf(out):
    return torch.full_like(out, math.inf)


def _all_neg_inf(out):
    return torch.full_like(out, -math.inf)


def _both_inf(out):
    values = torch.full_like(out, math.inf)
    values[..., ::2] = -math.inf
    return values


def _nan(out):
    return out * math.nan


# fault -> (sentinel's op, value in anomalies.jsonl, is_nan in the table, `trainmon overflow`'s label)
CASES = {
    "all_pos_inf": (_all_pos_inf, "+inf", "inf", 0, "+Inf (infs="),
    "all_neg_inf": (_all_neg_inf, "-inf", "-inf", 0, "-Inf (infs="),
    "pos_and_neg_inf": (_both_inf, "+inf/-inf", "inf", 0, "+Inf/-Inf (infs="),
    "nan": (_nan, "nan", "nan", 1, "NaN (nans="),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_inf_told_from_nan_with_one_call_index(output_dir, write_config, capsys, caplog, case, device):
    fault, op, value, is_nan, overflow_label = CASES[case]
    model = make_model(device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    clock = Clock(model, 1)
    dict(model.named_modules())[MODULE].register_forward_hook(
        lambda m, args, out: fault(out) if clock.at(STEP, 0) else None)
    # min/max make the records count +Inf apart (pinfs), which `trainmon overflow` words the sign from
    monitor = TrainerMon(write_config(**{**STATS, "ops": ["norm", "min", "max", "nans", "infs"], "format": ["db"]},
                                      sentinel=True))
    monitor.set_monitor(model, optimizer=optimizer)
    batches = []
    monitor._api.write = batches.append
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        run_steps(model, optimizer, 3)
    monitor.stop()

    # the sentinel's probe and the statistic record of the tensor: one call index
    batch = batches[STEP]
    name = f"{MODULE}.output"
    probed = [k.call_index for k in batch.flag_keys if (k.family, k.name) == ("actv", name)]
    recorded = [k.call_index for k in batch.keys if (k.family, k.name) == ("actv", name)]
    assert len(probed) == 1 and recorded == probed
    call = probed[0]

    line = next(r.getMessage() for r in caplog.records if "anomaly at" in r.getMessage())
    assert f"step {STEP} micro-step 0: {MODULE} forward output (sentinel: nonfinite={op}, call {call})" in line

    rows = [json.loads(x) for x in open(monitor.output_dir / "anomalies.jsonl")]
    first = next(r for r in rows if r["first"] and r["step"] == STEP)
    assert (first["module"], first["tensor"], first["op"], first["value"], first["call_index"]) == \
        (MODULE, "output", op, value, call)
    assert {r["call_index"] for r in rows if (r["module"], r["phase"], r["step"]) == (MODULE, "forward", STEP)} \
        == {call}

    with sqlite3.connect(monitor.output_dir / "monitor.db") as conn:
        table = conn.execute("SELECT op, is_nan, call_index FROM anomalies WHERE first = 1 AND step = ?",
                             (STEP,)).fetchall()
    assert table == [(op, is_nan, call)]

    report = nan_analyze_json(monitor.output_dir.parent, capsys)
    assert {k: report["first_record"][k] for k in ("module", "tensor", "step", "call_index", "op", "value")} == \
        {"module": MODULE, "tensor": "output", "step": STEP, "call_index": call, "op": op, "value": value}

    assert cli_main(["overflow", str(monitor.output_dir.parent), "--json"]) == 1  # 1: found
    overflow = json.loads(capsys.readouterr().out)["modules"][0]
    assert (overflow["module"], overflow["tensor"], overflow["call_index"]) == (MODULE, "output", call)
    assert overflow["what"].startswith(overflow_label)
    assert cli_main(["overflow", str(monitor.output_dir.parent)]) == 1
    assert overflow_label in capsys.readouterr().out
