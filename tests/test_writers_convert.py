"""Reading back and converting: msprobe's own CSV directories to db and TensorBoard, and `trainmon show`."""
import math
import sqlite3

import numpy as np
import pytest

from writer_helpers import integrity, tensorboard_scalars
from trainmon import open_run
from trainmon.cli import main

HEADER_ACTV = "vpp_stage,name,step,micro_step,norm,min,max,mean,nans,zeros,shape,dtype\n"
HEADER_PARAM = "vpp_stage,name,step,norm,min,max,mean,nans,zeros,shape,dtype\n"


def _mlp_row(rank: int, step: int, micro: int) -> str:
    if (rank, step, micro) == (1, 1, 0):  # a NaN element: torch's norm, min, max and mean are NaN
        return f'0,layers.0.mlp.output,{step},{micro},nan,nan,nan,nan,3,0.0,"[2, 32, 64]",torch.float32\n'
    return (f'0,layers.0.mlp.output,{step},{micro},12.5,-1.0,{"inf" if step else 2.0},0.25,0,0.0,"[2, 32, 64]",'
            'torch.float32\n')


def msprobe_output(root):
    """Two ranks in msprobe's layout `<time>-rank<R>-<uuid>/`, with a NaN, an Inf and an empty cell."""
    for rank in (0, 1):
        d = root / f"Nov22_07-00-0{rank}-rank{rank}-1a2b3c4{rank}"
        d.mkdir(parents=True)
        (d / "actv_0-1.csv").write_text(HEADER_ACTV + "".join(
            f'0,embed.output,{step},{micro},{64.788261023307 + rank + step + micro},-3.472946166992,3.739976406097,'
            f'0.00294669929,0,0.015625,"[2, 32, 64]",torch.float32\n' + _mlp_row(rank, step, micro)
            for step in (0, 1) for micro in (0, 1)))
        (d / "grad_reduced_0-1.csv").write_text(HEADER_PARAM + "".join(
            f'0,head.weight,{step},{1.008559711228 * (step + 1)},-0.061745397747,0.073422640562,1.9e-11,0,0,'
            f'"[128, 64]",torch.float32\n' for step in (0, 1)))
        (d / "exp_avg_1-1.csv").write_text(HEADER_PARAM + "0,head.weight,1,0.5,,,,0,0,\"[128, 64]\",torch.float32\n")
    return root


OPS = ["norm", "min", "max", "mean", "nans", "zeros"]
INDEX = ["rank", "family", "name", "step", "micro_step"]


def keyed(frame):
    return frame.assign(micro_step=frame.micro_step.fillna(-1)).set_index(INDEX).sort_index()


def test_reading_msprobe_output_by_family_tag_and_step(tmp_path):
    run = open_run(msprobe_output(tmp_path / "msprobe"))
    assert run.ranks == [0, 1]
    actv = run.family("actv")
    assert len(actv) == 16 and set(actv["rank"]) == {0, 1}
    one = run.tag("0:embed.output:1/rank1/actv")
    assert list(one.step) == [0, 1] and list(one.norm) == [64.788261023307 + 1 + s + 1 for s in (0, 1)]
    assert run.tag("0:head.weight/rank0/post_grad", steps=(1, 1)).norm.tolist() == [1.008559711228 * 2]
    at_step = run.step(1)
    assert set(at_step.family) == {"actv", "grad_reduced", "exp_avg"} and set(at_step.step) == {1}
    bad = at_step[(at_step["rank"] == 1) & (at_step.name == "layers.0.mlp.output") & (at_step.micro_step == 0)]
    assert math.isnan(bad.norm.iloc[0]) and bad.nans.iloc[0] == 3 and math.isnan(bad["max"].iloc[0])
    inf = at_step[(at_step["rank"] == 0) & (at_step.name == "layers.0.mlp.output") & (at_step.micro_step == 0)]
    assert inf["max"].iloc[0] == math.inf
    assert math.isnan(run.family("exp_avg")["min"].iloc[0])  # empty cell: no value


def test_csv2db_db2tb_and_csv2tb_round_trip(tmp_path, capsys):
    src = msprobe_output(tmp_path / "msprobe")
    assert main(["csv2db", str(src), str(tmp_path / "db"), "--quiet"]) == 0
    assert main(["db2tb", str(tmp_path / "db"), str(tmp_path / "db_tb"), "--quiet"]) == 0
    assert main(["csv2tb", str(src), str(tmp_path / "csv_tb")]) == 0  # with the progress bar
    assert "steps written" in capsys.readouterr().out

    csv = keyed(open_run(src).records())
    for rank in (0, 1):
        assert integrity(tmp_path / "db" / f"rank_{rank}" / "monitor.db") == "ok"
    db = keyed(open_run(tmp_path / "db", source="db").records())
    assert db.index.equals(csv.index)
    for op in OPS:
        np.testing.assert_allclose(db[op].to_numpy(), csv[op].to_numpy(), rtol=1e-13, atol=0, err_msg=op)
    assert [list(s) for s in db["shape"]] == [list(s) for s in csv["shape"]]

    expected = {}
    for (rank, family, name, step, micro), row in csv.iterrows():
        for op in OPS:
            # a NaN figure of a tensor with a NaN element is kept; an empty cell is not
            if not (math.isnan(row[op]) and not (op in ("norm", "min", "max", "mean") and row["nans"])):
                expected[(f"{row['tag']}_{op}", step)] = row[op]
    for converted in ("db_tb", "csv_tb"):
        events = {}
        for rank in (0, 1):
            events.update(tensorboard_scalars(tmp_path / converted / f"rank_{rank}"))
        assert set(events) == set(expected), converted
        for key, value in expected.items():
            assert events[key] == pytest.approx(value, rel=1e-6, nan_ok=True), (converted, key)


def test_csv2db_keeps_nan_apart_from_missing(tmp_path):
    src = msprobe_output(tmp_path / "msprobe")
    assert main(["csv2db", str(src), str(tmp_path / "db"), "--quiet"]) == 0
    with sqlite3.connect(tmp_path / "db" / "rank_1" / "monitor.db") as conn:
        nan_row = conn.execute("SELECT r.sumsq, r.nan_fields, r.nans, r.count FROM records r JOIN tags t "
                               "ON t.id = r.tag_id WHERE t.name = 'layers.0.mlp.output' AND step = 1 "
                               "AND micro_step = 0").fetchone()
        missing = conn.execute("SELECT r.sumsq, r.\"min\", r.nan_fields FROM records r JOIN tags t "
                               "ON t.id = r.tag_id WHERE t.family = 'exp_avg'").fetchone()
    # the CSV's norm is NaN (torch's norm of a tensor with a NaN): the finite elements' sum of squares is unknown
    assert nan_row == (None, 0, 3.0, 2 * 32 * 64 - 3)
    assert missing == (0.25, None, 0)  # min not recorded: NULL without its bit


def test_show_prints_a_table_and_errors_name_the_problem(tmp_path, capsys):
    src = msprobe_output(tmp_path / "msprobe")
    assert main(["show", str(src), "--tag", "head.weight", "--step", "1:", "--ops", "norm,max"]) == 0
    out = capsys.readouterr().out
    assert "0:head.weight/rank0/post_grad" in out and "2.017119" in out and "rank1" in out
    assert "embed" not in out and "norm" in out and "mean" not in out
    (tmp_path / "empty").mkdir()
    assert main(["show", str(tmp_path / "empty")]) == 2
    assert "no monitor output" in capsys.readouterr().err
    (src / "Nov22_07-00-00-rank0-1a2b3c40" / "grad_reduced_0-1.csv").write_text(HEADER_PARAM + "0,head.weight,0,1.0")
    assert main(["show", str(src)]) == 2
    assert "grad_reduced_0-1.csv, line 2: 4 fields" in capsys.readouterr().err
