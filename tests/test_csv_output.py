"""End-to-end: a real training loop under TrainerMon writes msprobe-layout CSVs with correct figures."""
import glob
import os

import pytest
import torch

from reference import assert_ops_close, reference_ops
from training import batches, make_model, run_steps
from trainmon import TrainerMon
from trainmon.demo import lm_loss

pd = pytest.importorskip("pandas")  # the reader the CSV files are checked with (the `db` extra)

OPS = ["min", "max", "norm", "mean", "zeros", "nans"]
FULL = dict(targets={}, all_xy=True, xy_distribution=True, wg_distribution=True, param_distribution=True,
            mv_distribution=True, ops=OPS, format="csv", ndigits=17)


def read_family(rank_dir, family):
    files = sorted(glob.glob(os.path.join(rank_dir, f"{family}_*-*.csv")))
    files = [f for f in files if os.path.basename(f)[len(family) + 1].isdigit()]
    assert files, f"no {family} files in {os.listdir(rank_dir)}"
    return pd.concat([pd.read_csv(f, keep_default_na=False, na_values=[""]) for f in files], ignore_index=True)


def monitored_run(write_config, steps=3, grad_acc_steps=2, optimizer_kwargs=None, **config):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **(optimizer_kwargs or {}))
    monitor = TrainerMon(write_config(**{**FULL, **config}))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=grad_acc_steps)
    losses = run_steps(model, optimizer, steps, grad_acc_steps)
    monitor.stop()
    return monitor, losses


def test_file_names_columns_and_one_row_per_key(output_dir, write_config):
    monitor, _ = monitored_run(write_config, steps=3, grad_acc_steps=2, step_count_per_record=2)
    names = sorted(os.listdir(monitor.output_dir))
    for family in ["actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_origin", "param_updated",
                   "exp_avg", "exp_avg_sq"]:
        assert f"{family}_0-1.csv" in names and f"{family}_2-2.csv" in names, names
    actv = read_family(monitor.output_dir, "actv")
    assert list(actv.columns) == ["vpp_stage", "name", "step", "micro_step"] + OPS + ["shape", "dtype"]
    assert not actv.duplicated(["name", "step", "micro_step"]).any()
    assert set(actv.step) == {0, 1, 2} and set(actv.micro_step) == {0, 1}
    # the root module and the token ids: the ids are integers and never recorded
    assert ".output" in set(actv.name) and ".input" not in set(actv.name)
    assert "embed.output" in set(actv.name) and "embed.input" not in set(actv.name)
    assert "layers.0.mlp.0.input" in set(actv.name)
    grads = read_family(monitor.output_dir, "grad_reduced")
    assert list(grads.columns) == ["vpp_stage", "name", "step"] + OPS + ["shape", "dtype"]
    params = {n for n, _ in make_model().named_parameters()}
    assert set(grads.name) == params
    assert len(grads) == 3 * len(params) and not grads.duplicated(["name", "step"]).any()
    assert grads.loc[grads.name == "head.weight", "shape"].iloc[0] == "[64, 32]"
    assert grads.dtype.unique().tolist() == ["torch.float32"]


def test_rows_follow_the_ranks_order_of_events(output_dir, write_config):
    """Activations are reduced in batches, and one modified in place (by the ReLU) in its own hook from step 1 on,
    so records reach the writer out of order; a CSV row has no call index, so its position must carry the
    order (nan-analyze reads it from CSV alone)."""
    import sqlite3

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(xy_distribution=True, forward_only=True, ops=["norm"], format=["csv", "db"]))
    monitor.set_monitor(model, optimizer=optimizer)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    monitor.stop()
    with sqlite3.connect(monitor.output_dir / "monitor.db") as conn:
        by_call = [name for (name,) in conn.execute(
            "SELECT t.name FROM records r JOIN tags t ON t.id = r.tag_id WHERE t.family = 'actv' AND r.step = 1 "
            "ORDER BY r.call_index")]
    written = read_family(monitor.output_dir, "actv")
    assert "0.output" in by_call and list(written[written.step == 1].name) == by_call


def test_figures_equal_direct_torch_computations(output_dir, write_config):
    """Replays the same run without the monitor and computes every figure with torch directly."""
    steps, ga = 3, 2
    monitor, losses = monitored_run(write_config, steps=steps, grad_acc_steps=ga)

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    named = dict(model.named_parameters())
    expected = {}
    outputs = {name: [] for name in ["layers.0.mlp", "layers.1.attn.qkv", "head"]}
    for name, kept in outputs.items():
        model.get_submodule(name).register_forward_hook(
            lambda module, args, output, kept=kept: kept.append(output.detach().clone()))

    def before_step(step):
        for name, p in named.items():
            expected[("grad_reduced", name, step)] = reference_ops(p.grad)
            expected[("param_origin", name, step)] = reference_ops(p)

    data = batches()
    ref_losses = []
    for step in range(steps):
        ref_losses += run_steps(model, optimizer, 1, ga, data=data, on_step=lambda _: before_step(step))
        for name, p in named.items():
            expected[("param_updated", name, step)] = reference_ops(p)
            expected[("exp_avg", name, step)] = reference_ops(optimizer.state[p]["exp_avg"])
            expected[("exp_avg_sq", name, step)] = reference_ops(optimizer.state[p]["exp_avg_sq"])
    assert ref_losses == losses

    for family in ["grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq"]:
        frame = read_family(monitor.output_dir, family)
        assert len(frame) == steps * len(named)
        for row in frame.to_dict("records"):
            assert_ops_close(row, expected[(family, row["name"], row["step"])], OPS,
                             context=f"{family} {row['name']} step {row['step']}")
    # single process: the accumulated grad before reduction is what the optimizer consumes
    unreduced = read_family(monitor.output_dir, "grad_unreduced")
    for row in unreduced.to_dict("records"):
        assert_ops_close(row, expected[("grad_reduced", row["name"], row["step"])], OPS)

    actv = read_family(monitor.output_dir, "actv").set_index(["name", "step", "micro_step"])
    for name, kept in outputs.items():
        assert len(kept) == steps * ga
        for call, tensor in enumerate(kept):
            step, micro = divmod(call, ga)
            row = actv.loc[(f"{name}.output", step, micro)].to_dict()
            assert_ops_close(row, reference_ops(tensor), OPS, context=f"{name} step {step} micro {micro}")


def test_grads_changed_through_data_are_read_again_at_the_step(output_dir, write_config):
    """A framework that reduces grads through `.grad.data` (DeepSpeed ZeRO-0 averages them so) leaves their
    `_version` as it was: grad_reduced still shows what the optimizer consumes."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(wg_distribution=True, ops=OPS, format="csv", ndigits=17))
    monitor.set_monitor(model, optimizer=optimizer)
    consumed = {}

    def reduce_through_data(step):
        for name, p in model.named_parameters():
            p.grad.data.mul_(0.5)
            consumed[(name, step)] = reference_ops(p.grad)

    run_steps(model, optimizer, 2, on_step=reduce_through_data)
    monitor.stop()
    reduced = read_family(monitor.output_dir, "grad_reduced")
    unreduced = read_family(monitor.output_dir, "grad_unreduced").set_index(["name", "step"]).norm
    assert len(reduced) == len(consumed)
    for row in reduced.to_dict("records"):
        assert_ops_close(row, consumed[(row["name"], row["step"])], OPS, context=f"{row['name']} {row['step']}")
        assert row["norm"] == pytest.approx(unreduced[(row["name"], row["step"])] / 2, rel=1e-6)


def test_per_micro_batch_grad_is_each_micro_batch_contribution(output_dir, write_config):
    ga = 3
    monitor, _ = monitored_run(write_config, steps=2, grad_acc_steps=ga, monitor_mbs_grad=True,
                               xy_distribution=False)
    frame = read_family(monitor.output_dir, "grad_unreduced")
    assert "micro_step" in frame.columns
    assert sorted(set(frame.micro_step)) == [0, 1, 2]

    # Reference: the grad of each micro-batch alone.
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches()
    head = model.head.weight
    for step in range(2):
        for micro in range(ga):
            before = head.grad.clone() if head.grad is not None else torch.zeros_like(head)
            tokens, labels = next(data)
            (lm_loss(model, tokens, labels) / ga).backward()
            contribution = head.grad - before
            row = frame[(frame.name == "head.weight") & (frame.step == step) & (frame.micro_step == micro)]
            assert len(row) == 1
            assert_ops_close(row.iloc[0].to_dict(), reference_ops(contribution), ["norm", "max", "min"],
                             rel=1e-4, abs_=1e-6)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_an_element_no_grad_has_reached_has_an_update_ratio_of_0_not_nan(output_dir, write_config):
    """An embedding's unused rows have both Adam moments 0: their ratio is 0 (a NaN there would be the monitor's own,
    reported as the training's); a NaN in a moment still shows in the ratio."""
    torch.manual_seed(0)
    model = torch.nn.Embedding(100, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(ur_distribution=True, ops=["norm", "nans"], format=["csv"]))
    monitor.set_monitor(model, optimizer=optimizer)
    for step in range(2):
        model(torch.tensor([1, 2, 3])).square().sum().backward()
        if step == 1:
            optimizer.state[model.weight]["exp_avg"][7, 0] = float("nan")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    monitor.stop()
    ratio = read_family(monitor.output_dir, "adam_ratio").set_index("step")
    assert ratio.loc[0, "nans"] == 0 and ratio.loc[0, "norm"] > 0
    assert ratio.loc[1, "nans"] == 1


@pytest.mark.parametrize("mode", [{"foreach": False}, {"foreach": True}, {"fused": True}])
def test_adam_moments_update_ratio_and_sign_agreement(output_dir, write_config, mode):
    monitor, _ = monitored_run(write_config, steps=2, grad_acc_steps=1, optimizer_kwargs=mode,
                               xy_distribution=False, ur_distribution=True, mg_direction=True)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **mode)
    beta1, beta2 = optimizer.defaults["betas"]
    eps = optimizer.defaults["eps"]
    data = batches()
    frames = {f: read_family(monitor.output_dir, f) for f in ["exp_avg", "adam_update", "adam_ratio",
                                                              "mg_direction"]}
    p = model.layers[1].mlp[0].weight
    for step in range(2):
        tokens, labels = next(data)
        lm_loss(model, tokens, labels).backward()
        optimizer.step()
        state = optimizer.state[p]
        m_hat = state["exp_avg"] / (1 - beta1 ** (step + 1))
        v_hat = state["exp_avg_sq"] / (1 - beta2 ** (step + 1))
        expect = {"exp_avg": state["exp_avg"], "adam_update": m_hat / (v_hat.sqrt() + eps),
                  "adam_ratio": m_hat / v_hat.sqrt(),
                  "mg_direction": (torch.sign(p.grad) == torch.sign(state["exp_avg"])).float()}
        for family, tensor in expect.items():
            frame = frames[family]
            row = frame[(frame.name == "layers.1.mlp.0.weight") & (frame.step == step)]
            assert len(row) == 1, family
            assert_ops_close(row.iloc[0].to_dict(), reference_ops(tensor), ["norm", "mean", "max"], rel=1e-4,
                             context=f"{family} step {step}")
        optimizer.zero_grad(set_to_none=True)
