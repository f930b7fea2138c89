"""Merging the records of a tensor's pieces gives the record of the whole tensor (single process)."""
import math

import torch

from trainmon.engine import buffers, stats
from trainmon.hooks.collector import StepCollector
from trainmon.adapters.patching import patch_attribute
from trainmon.hooks.shard_merge import identity_record, piece_records
from trainmon.hooks.state import HookState


def test_merged_pieces_equal_the_whole_tensor():
    torch.manual_seed(0)
    whole = [torch.randn(40) * 3, torch.randn(7, 5)]
    whole[0][[3, 17]] = float("nan")
    whole[0][5] = float("inf")
    whole[1][2, 2] = 0.0
    fields = stats.fields_for_ops(["norm", "min", "max", "mean", "zeros", "nans", "infs"])
    state = HookState(StepCollector(1e-8, fields, 0), 1, True)
    # three "ranks": the second holds nothing of the second tensor
    flat = whole[1].reshape(-1)
    pieces = [[whole[0][:10], flat[:20]], [whole[0][10:25], None], [whole[0][25:], flat[20:]]]
    gathered = torch.stack([piece_records(state, p, torch.device("cpu")) for p in pieces])
    merged = buffers.merge_records(gathered)
    direct = stats.tensor_records(whole, 1e-8, state.collector.fields)
    for got, want in zip(merged, direct):
        for g, w in zip(got.tolist(), want.tolist()):
            assert math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-9), (merged, direct)  # fp32 accumulation


def test_identity_record_leaves_a_record_unchanged():
    row = stats.tensor_records([torch.tensor([1.0, -2.0])], 1e-8, stats.fields_for_ops(["norm"]))
    both = buffers.merge_records(torch.stack([row, identity_record("cpu").unsqueeze(0)]))
    assert torch.equal(both, row)


def test_patch_attribute_restores_what_the_instance_had():
    class Owner:
        def step(self):
            return "class"

    plain, own = Owner(), Owner()
    own.step = lambda: "instance"
    undo_plain = patch_attribute(plain, "step", lambda: "patched")
    undo_own = patch_attribute(own, "step", lambda: "p")
    assert plain.step() == "patched" and own.step() == "p"
    undo_plain()
    undo_own()
    assert plain.step() == "class" and "step" not in vars(plain) and own.step() == "instance"
