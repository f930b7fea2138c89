"""Heatmaps drawn with matplotlib (Agg, no display): module × step, rank × step, module × rank.

Finite values are coloured by log10 |value|; NaN, +Inf and −Inf have their own colours and a cell with
no record is grey, so a non-finite value is never mistaken for a large one or for a gap. The first
anomaly (the alert's place) is circled.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from trainmon.watch.history import RANK_SERIES, History

NAN_RGB = (1.0, 0.0, 1.0)  # magenta
POS_INF_RGB = (0.85, 0.0, 0.0)  # red
NEG_INF_RGB = (0.0, 0.75, 1.0)  # light blue
MISSING_RGB = (0.85, 0.85, 0.85)  # grey
WIDTH_IN, HEIGHT_IN, DPI = 10, 6, 100  # every picture is 1000 x 600 pixels
MAX_TICKS = 30


@dataclass
class Picture:
    """One heatmap: its name (the PNG file and the TensorBoard tag) and the PNG."""

    name: str
    png: bytes
    height: int = HEIGHT_IN * DPI
    width: int = WIDTH_IN * DPI


def _import_matplotlib():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("heatmaps need matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg", force=False)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    return Figure, FigureCanvasAgg


def _colours(matrix: np.ndarray, missing: np.ndarray):
    """RGB of each cell and the (low, high) of the log10 scale of the finite cells."""
    from matplotlib import colormaps
    finite = np.isfinite(matrix) & ~missing
    logs = np.full(matrix.shape, np.nan)
    magnitude = np.abs(matrix, where=finite, out=np.zeros_like(matrix))
    positive = finite & (magnitude > 0)
    logs[positive] = np.log10(magnitude[positive])
    low, high = (np.nanmin(logs), np.nanmax(logs)) if positive.any() else (0.0, 1.0)
    low = low if high > low else high - 1.0
    logs[finite & ~positive] = low  # exact zeros sit at the bottom of the scale
    scaled = (logs - low) / (high - low)
    rgb = colormaps["viridis"](np.nan_to_num(scaled, nan=0.0))[..., :3]
    rgb[missing] = MISSING_RGB
    rgb[np.isnan(matrix) & ~missing] = NAN_RGB
    rgb[np.isposinf(matrix)] = POS_INF_RGB
    rgb[np.isneginf(matrix)] = NEG_INF_RGB
    return rgb, (low, high)


def draw(matrix: np.ndarray, missing: np.ndarray, rows: Sequence[str], columns: Sequence, title: str,
         row_axis: str, column_axis: str, mark: Optional[tuple[int, int]] = None, note: str = "") -> bytes:
    """A PNG of `matrix` (rows × columns; `missing` marks cells with no value)."""
    Figure, Canvas = _import_matplotlib()
    from matplotlib import colormaps
    from matplotlib.colors import Normalize
    from matplotlib.cm import ScalarMappable
    from matplotlib.patches import Patch
    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    Canvas(fig)
    ax = fig.add_axes((0.28, 0.12, 0.55, 0.78))
    rgb, (low, high) = _colours(matrix, missing)
    ax.imshow(rgb, aspect="auto", interpolation="nearest")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(column_axis)
    ax.set_ylabel(row_axis)
    for axis, labels, setter, label_setter in ((0, rows, ax.set_yticks, ax.set_yticklabels),
                                               (1, columns, ax.set_xticks, ax.set_xticklabels)):
        every = max(1, math.ceil(len(labels) / MAX_TICKS))
        ticks = list(range(0, len(labels), every))
        setter(ticks)
        label_setter([str(labels[i]) for i in ticks], fontsize=6, rotation=0 if axis == 0 else 90)
    if mark is not None:
        ax.plot([mark[1]], [mark[0]], marker="o", markersize=14, markerfacecolor="none", markeredgecolor="white",
                markeredgewidth=2.5)
        ax.plot([mark[1]], [mark[0]], marker="o", markersize=14, markerfacecolor="none", markeredgecolor="black",
                markeredgewidth=1)
    if note:
        fig.text(0.01, 0.01, note, fontsize=8)
    bar = fig.add_axes((0.85, 0.35, 0.02, 0.55))
    fig.colorbar(ScalarMappable(Normalize(low, high), colormaps["viridis"]), cax=bar, label="log10 |value|")
    fig.legend(handles=[Patch(color=NAN_RGB, label="NaN"), Patch(color=POS_INF_RGB, label="+Inf"),
                        Patch(color=NEG_INF_RGB, label="-Inf"), Patch(color=MISSING_RGB, label="no record")],
               loc="lower right", fontsize=7, frameon=False)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=DPI)
    return out.getvalue()


def _matrix(cells: list[list[Optional[float]]]) -> tuple[np.ndarray, np.ndarray]:
    missing = np.array([[v is None for v in row] for row in cells], dtype=bool).reshape(len(cells), -1)
    values = np.array([[np.nan if v is None else v for v in row] for row in cells],
                      dtype=np.float64).reshape(len(cells), -1)
    return values, missing


def pictures(history: History, first: Optional[dict] = None, families: Optional[Sequence[str]] = None) -> list[Picture]:
    """Every heatmap of the window: module × step and module × rank per family, rank × step per series.

    Args:
        history: the window.
        first: the alert's first place ({rank, step, module, ...}) to circle, or None.
        families: only these families (default: all).
    """
    out = []
    steps = history.steps()
    note = "" if first is None else (f"circled: first NaN/Inf, rank {first['rank']} step {first['step']} "
                                     f"{first['module'] or '<root>'} {first['phase']} {first['tensor']}")
    for family, labels in history.rows.items():
        if families is not None and family not in families:
            continue
        rows = list(labels)
        cells = [[column.get(family, {}).get(label) for _, column in history.columns] for label in rows]
        mark = None
        if first is not None and first["step"] in steps:
            hit = [i for i, label in enumerate(rows) if label.split(":")[-1].startswith(first["module"])]
            if hit and first["module"]:
                mark = (hit[0], steps.index(first["step"]))
        out.append(Picture(f"{family}_module_x_step", draw(*_matrix(cells), rows, steps,
                           f"{family}: {history.op} (max across ranks), module x step", "tensor", "step", mark, note)))
        latest_step, latest = history.latest
        by_label = latest.get(family, {})
        ranks = sorted({r for values in by_label.values() for r in values})
        if len(ranks) > 1:  # one rank: the module x step picture already says it all
            cells = [[by_label.get(label, {}).get(rank) for rank in ranks] for label in rows]
            out.append(Picture(f"{family}_module_x_rank", draw(*_matrix(cells), rows, ranks,
                               f"{family}: {history.op} at step {latest_step}, module x rank", "tensor", "rank")))
    for series in RANK_SERIES:
        columns = [(step, values[series]) for step, values in history.rank_columns if series in values]
        if not columns:
            continue
        ranks = sorted({r for _, values in columns for r in values})
        cells = [[values.get(rank) for _, values in columns] for rank in ranks]
        column_steps = [step for step, _ in columns]
        mark = None
        if first is not None and first["step"] in column_steps and first["rank"] in ranks:
            mark = (ranks.index(first["rank"]), column_steps.index(first["step"]))
        out.append(Picture(f"{series}_rank_x_step", draw(*_matrix(cells), ranks, column_steps,
                           f"{series}, rank x step", "rank", "step", mark, note)))
    return out
