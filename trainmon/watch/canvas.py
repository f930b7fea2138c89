"""One heatmap drawn into a PNG with matplotlib (Agg, no display).

Every row is labelled: the picture is WIDTH pixels wide and grows ROW_PX pixels a row, from MIN_HEIGHT
(room for the colour bar and the legend); `heatmap` keeps a picture to MAX_ROWS rows. Columns are labelled
as often as their labels fit. Finite values are coloured by log10 |value|; NaN, +Inf and −Inf have their
own colours and a cell with no record is grey, so a non-finite value is never mistaken for a large one or
for a gap. A cell can be circled (the first anomaly).
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

NAN_RGB = (1.0, 0.0, 1.0)  # magenta
POS_INF_RGB = (0.85, 0.0, 0.0)  # red
NEG_INF_RGB = (0.0, 0.75, 1.0)  # light blue
MISSING_RGB = (0.85, 0.85, 0.85)  # grey
DPI = 100
WIDTH = 1000
ROW_PX = 12  # a 7-point label is ~10 pixels high
MAX_ROWS = 256  # the tallest picture: ~3,200 pixels
MIN_HEIGHT = 600
TOP, BOTTOM, RIGHT = 40, 100, 190  # pixels: the title; column labels, axis name and note; colour bar and legend
COLUMN_LABEL_PX = 14  # one rotated column label
CHAR_PX = 5.5  # one character of a row label
LABEL_PT = 7


@dataclass
class Picture:
    """One heatmap: its name (the PNG file and the TensorBoard tag), the PNG and its size in pixels, the row
    labels as drawn and the cells' box in the PNG (left, top, right, bottom pixels)."""

    name: str
    png: bytes
    height: int
    width: int
    rows: tuple[str, ...] = ()
    area: tuple[int, int, int, int] = (0, 0, 0, 0)


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


def draw(name: str, matrix: np.ndarray, missing: np.ndarray, rows: Sequence[str], columns: Sequence[str],
         title: str, row_axis: str, column_axis: str, mark: Optional[tuple[int, int]] = None,
         note: str = "") -> Picture:
    """A picture of `matrix` (rows × columns; `missing` marks cells with no value), `mark` (row, column) circled."""
    Figure, Canvas = _import_matplotlib()
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.patches import Patch
    count, width = matrix.shape
    height = max(MIN_HEIGHT, TOP + BOTTOM + ROW_PX * count)
    left = int(min(WIDTH // 2, 40 + CHAR_PX * max(map(len, rows), default=0)))
    cells = (left, TOP, WIDTH - RIGHT, height - BOTTOM)
    fig = Figure(figsize=(WIDTH / DPI, height / DPI), dpi=DPI)
    Canvas(fig)
    ax = fig.add_axes(_fraction(cells, height))
    rgb, (low, high) = _colours(matrix, missing)
    ax.imshow(rgb, aspect="auto", interpolation="nearest")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(column_axis)
    ax.set_ylabel(row_axis)
    ax.yaxis.set_label_coords(-(left - 14) / (cells[2] - cells[0]), 0.5)  # left of the row labels
    # plain texts, not ticks: a matplotlib tick is five artists, and drawing them was most of a picture's time
    ax.set_yticks([])
    labels = [ax.text(-0.01, i, label, transform=ax.get_yaxis_transform(), ha="right", va="center",
                      fontsize=LABEL_PT) for i, label in enumerate(rows)]
    every = max(1, math.ceil(width * COLUMN_LABEL_PX / (cells[2] - cells[0])))
    ax.set_xticks(range(0, width, every), [columns[i] for i in range(0, width, every)], fontsize=LABEL_PT,
                  rotation=90)
    if mark is not None:  # white under black: visible on any colour
        for colour, edge in (("white", 2.5), ("black", 1.0)):
            ax.plot([mark[1]], [mark[0]], marker="o", markersize=14, markerfacecolor="none", markeredgecolor=colour,
                    markeredgewidth=edge)
    if note:
        fig.text(0.01, 6 / height, note, fontsize=8)
    bar = fig.add_axes(_fraction((WIDTH - RIGHT + 50, TOP, WIDTH - RIGHT + 65, TOP + 280), height))
    fig.colorbar(ScalarMappable(Normalize(low, high), colormaps["viridis"]), cax=bar, label="log10 |value|")
    fig.legend(handles=[Patch(color=NAN_RGB, label="NaN"), Patch(color=POS_INF_RGB, label="+Inf"),
                        Patch(color=NEG_INF_RGB, label="-Inf"), Patch(color=MISSING_RGB, label="no record")],
               loc="upper left", bbox_to_anchor=((WIDTH - RIGHT + 30) / WIDTH, 1 - (TOP + 300) / height),
               fontsize=LABEL_PT, frameon=False)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=DPI)
    return Picture(name, out.getvalue(), height, WIDTH, tuple(t.get_text() for t in labels), cells)


def _fraction(box: tuple[int, int, int, int], height: int) -> tuple[float, float, float, float]:
    """matplotlib's (left, bottom, width, height) fractions of a (left, top, right, bottom) pixel box."""
    left, top, right, bottom = box
    return left / WIDTH, 1 - bottom / height, (right - left) / WIDTH, (bottom - top) / height
