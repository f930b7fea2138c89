"""A watch window built in memory: `layers` layers of `tensors` tensors each, on `ranks` ranks, with a NaN
and an +Inf at chosen (layer, step), for the heatmap tests."""
from __future__ import annotations

import numpy as np

from trainmon.core.records import ACTV
from trainmon.watch.aggregate import Place, StepFigures, StepRows
from trainmon.watch.history import History

OP = "norm"


def names(layers: int, tensors: int, backward: bool = False) -> list[str]:
    """Tensor names in the order they come: an embedding, then `layers` numbered layers (`backward`: the
    other way round, as activation grads come)."""
    order = reversed(range(layers)) if backward else range(layers)
    return ["embed.output"] + [f"layers.{i}.mlp.{j}.output" for i in order for j in range(tensors)]


def history(layers: int, tensors: int, ranks: int, steps: int, nan: tuple[int, int], inf: tuple[int, int],
            bad_rank: int, backward: bool = False, places: bool = False) -> History:
    """The window: values 1 + (position of the layer) + step / 100 on every rank; at `nan` (layer position,
    step) the last tensor of the layer is NaN on `bad_rank`, at `inf` +Inf; the loss is NaN on `bad_rank`
    at the NaN's step. `places`: each step holding one says where (`StepFigures.worst`), as the daemon's do."""
    keys = [(ACTV, name, 0) for name in names(layers, tensors, backward)]
    out = History(OP, window=steps)
    for step in range(steps):
        value = np.array([1.0 + (0 if k == 0 else (k - 1) // tensors) + step / 100 for k in range(len(keys))])
        per_rank = np.tile(value, (ranks, 1))  # ranks x tensors
        worst = None
        for (layer, at), bad in ((nan, np.nan), (inf, np.inf)):
            if at == step:
                per_rank[bad_rank, 1 + layer * tensors + tensors - 1] = bad
                worst = worst or Place(*keys[1 + layer * tensors + tensors - 1], bad_rank, 0)
        high = np.where(np.isnan(per_rank).any(axis=0), np.nan, per_rank.max(axis=0))
        figures = StepFigures(step, {(*key, OP): (v, v, h, bad_rank) for key, v, h in zip(keys, value, high)},
                              worst=worst if places else None)
        tag, rank = np.meshgrid(np.arange(len(keys)), np.arange(ranks))
        figures.rows = StepRows(keys, tag.ravel(), rank.ravel(), {OP: per_rank.ravel()},
                                {OP: np.ones(per_rank.size, dtype=bool)})
        loss = {r: 2.0 - step / 100 for r in range(ranks)}
        if step == nan[1]:
            loss[bad_rank] = np.nan
        figures.scalars = {"loss": loss}
        out.add(figures)
    return out
