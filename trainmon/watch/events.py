"""The daemon's TensorBoard event file: scalars, heatmap images, alert text and the custom-scalars layout.

Written with the writers' `EventWriter`. `checkpoint()` gives the file and its size after a flush; the
state file keeps it, and a restarted daemon cuts the file back to that size and appends, so a `kill -9`
between a write and the state file leaves no duplicate event and loses none.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from trainmon.writers.tensorboard_sink import EVENT_FILE_PREFIX, EventWriter

ALERT_TAG = "alerts"


def _string_tensor(data: bytes):
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.compat.proto.types_pb2 import DT_STRING
    return TensorProto(dtype=DT_STRING, string_val=[data], tensor_shape=TensorShapeProto())


def _plugin_metadata(plugin: str, content: bytes = b""):
    from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
    return SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=plugin, content=content))


class WatchEvents:
    """One event file in a run directory of the daemon's view.

    Args:
        logdir: the run directory.
        resume: a `checkpoint()` of an earlier daemon on the same directory, or None for a new file. A new file
            replaces the event files there: an earlier daemon, killed before its state file named them, left them
            (TensorBoard would show their events twice).
    """

    def __init__(self, logdir: Path, resume: Optional[dict] = None):
        self.logdir = logdir
        target = None
        if resume and (logdir / resume["file"]).is_file():
            target = (logdir / resume["file"], resume["size"])
        else:
            for orphan in logdir.glob(f"{EVENT_FILE_PREFIX}*"):
                orphan.unlink()
        self._writer = EventWriter(logdir, resume=target)
        from tensorboard.compat.proto.summary_pb2 import Summary
        self._summary = Summary

    def scalars(self, step: int, values: list[tuple[str, float]]) -> None:
        """(tag, value) pairs of one step; ±Inf is written as NaN: TensorBoard's charts draw a NaN (a marker), but
        not an infinity (the line ends there and the chart breaks, each later NaN placed at it)."""
        self._writer.add(step, [(tag, value if math.isfinite(value) else math.nan) for tag, value in values])

    def images(self, step: int, pictures: list[tuple[str, bytes, int, int]]) -> None:
        """(tag, PNG bytes, height, width) of each picture."""
        self._writer.add_values(step, [
            self._summary.Value(tag=tag, image=self._summary.Image(height=h, width=w, colorspace=4,
                                                                    encoded_image_string=png))
            for tag, png, h, w in pictures])

    def text(self, step: int, tag: str, markdown: str) -> None:
        """A TensorBoard text-plugin entry."""
        from tensorboard.plugins.text import metadata
        value = self._summary.Value(tag=tag, tensor=_string_tensor(markdown.encode()),
                                    metadata=_plugin_metadata(metadata.PLUGIN_NAME))
        self._writer.add_values(step, [value])

    def layout(self, categories: dict[str, list]) -> None:
        """The custom-scalars layout, categories in the given order (`view.layout`): each chart is
        ("multiline", title, [tag regexes]) or ("margin", title, median tag, low tag, high tag)."""
        from tensorboard.plugins.custom_scalar import layout_pb2, metadata

        def chart(spec):
            if spec[0] == "multiline":
                return layout_pb2.Chart(title=spec[1], multiline=layout_pb2.MultilineChartContent(tag=spec[2]))
            _, title, median, low, high = spec
            return layout_pb2.Chart(title=title, margin=layout_pb2.MarginChartContent(series=[
                layout_pb2.MarginChartContent.Series(value=median, lower=low, upper=high)]))

        data = layout_pb2.Layout(category=[layout_pb2.Category(title=title, closed=index > 0,
                                                               chart=[chart(spec) for spec in charts])
                                           for index, (title, charts) in enumerate(categories.items())])
        value = self._summary.Value(tag=metadata.CONFIG_SUMMARY_TAG, tensor=_string_tensor(data.SerializeToString()),
                                    metadata=_plugin_metadata(metadata.PLUGIN_NAME))
        self._writer.add_values(0, [value])

    def checkpoint(self) -> dict:
        """{file, size}: what `resume` takes; flushes first."""
        return {"file": self._writer.path.name, "size": self._writer.size()}

    def close(self) -> None:
        self._writer.close()
