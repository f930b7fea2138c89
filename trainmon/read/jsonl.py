"""Reading `anomalies.jsonl`: every whole record; a last line cut short by a crash is dropped with a warning."""
from __future__ import annotations

import json
import mmap
import re
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from trainmon.core.events import AnomalyEvent
from trainmon.read.errors import InputError

Warn = Callable[[str], None]
# The step of a line as AnomalyEvent.to_json writes it: read without parsing the line, so that lines of
# steps another source holds cost a regex, not a JSON parse and an event. A line it does not match is parsed.
_STEP = re.compile(rb'"step": (\d+),')


def read_jsonl(path: Path, warn: Optional[Warn] = None,
               skip_step: Optional[Callable[[int], bool]] = None) -> Iterator[AnomalyEvent]:
    """The anomalies of one file, in file order.

    A last line without its newline that does not parse is what a killed writer leaves: it is dropped
    and `warn` is told (naming the file). Any other bad line is an error.

    Args:
        path: the anomalies.jsonl file.
        warn: receives the warning about a cut-short last line.
        skip_step: records of the steps it returns True for are not built (another source holds them).

    Raises:
        InputError: a line that is not an anomaly record (named by file and line).
    """
    with open(path, "rb") as fh:
        start, lines = _skipped_head(fh, skip_step) if skip_step is not None else (0, 0)
        fh.seek(start)
        for number, raw in enumerate(fh, lines + 1):
            if not raw.strip():
                continue
            if skip_step is not None and raw.endswith(b"\n"):
                step = _STEP.search(raw)
                if step is not None and skip_step(int(step[1])):
                    continue
            try:
                yield AnomalyEvent.from_json(json.loads(raw))
            except (ValueError, TypeError) as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
                if not raw.endswith(b"\n") and not fh.peek(1):
                    if warn is not None:
                        warn(f"{path}, line {number}: the last line is cut short (the writer was stopped); "
                             f"read up to the last whole record")
                    return
                raise InputError.at(path, f"not an anomaly record: {err}", number) from None


def whole_lines(path: Path) -> int:
    """How many whole (newline-ended) lines the file has: counted in place (mmap), without reading it into
    Python objects."""
    with open(path, "rb") as fh:
        if fh.seek(0, 2) == 0:
            return 0
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            text = np.frombuffer(mapped, dtype=np.uint8)
            count = int(np.count_nonzero(text == ord("\n")))
            del text  # the map cannot close while an array views it
    return count


_CHUNK = 1 << 23


def _skipped_head(fh, skip_step: Callable[[int], bool]) -> tuple[int, int]:
    """(bytes, lines) of the file's whole lines when every one of them names a step that `skip_step` skips
    (the usual case beside a database that holds every step), found by a scan of the file in chunks of
    whole lines instead of a regex per line; else (0, 0)."""
    steps, lines, end = set(), 0, 0
    while chunk := fh.read(_CHUNK):
        chunk += fh.readline()  # to the end of the chunk's last line
        whole = chunk.rfind(b"\n") + 1  # short of the file's cut-short last line
        found = _leading_steps(chunk[:whole])
        if found is None:
            found = _STEP.findall(chunk, 0, whole)
            # one step per line: a quote inside a JSON string is escaped, so a line names its step once
            if len(found) != chunk.count(b"\n", 0, whole):
                return 0, 0
            found = map(int, set(found))
        steps.update(found)
        lines, end = lines + chunk.count(b"\n", 0, whole), end + whole
    if all(skip_step(step) for step in steps):
        return end, lines
    return 0, 0


def _leading_steps(lines: bytes) -> Optional[set[int]]:
    """The steps of whole lines that all begin as the first does, `{"rank": R, "step": S,` (as `to_json`
    writes them), read at once with numpy; None when they do not (the regex reads them then)."""
    text = np.frombuffer(lines, dtype=np.uint8)
    ends = np.flatnonzero(text == ord("\n"))
    key = lines.find(b'"step": ', 0, 64)
    if not len(ends) or key < 0 or not lines.startswith(b'{"rank": '):
        return None
    starts = np.concatenate(([0], ends[:-1] + 1))
    prefix = lines[:key + len(b'"step": ')]
    if (starts + len(prefix) + _DIGITS >= len(text)).any():
        return None
    if not all((text[starts + i] == byte).all() for i, byte in enumerate(prefix)):
        return None
    at, value, digits = starts + len(prefix), np.zeros(len(starts), dtype=np.int64), np.ones(len(starts), bool)
    for k in range(_DIGITS):
        digit = text[at + k].astype(np.int64) - ord("0")
        more = digits & (digit >= 0) & (digit <= 9)
        if k == 0 and not more.all():
            return None
        ended = digits & ~more
        if (text[at + k][ended] != ord(",")).any():  # a step ends at its comma
            return None
        value, digits = np.where(more, value * 10 + digit, value), more
        if not digits.any():
            return set(np.unique(value).tolist())
    return None


_DIGITS = 19  # the most digits of a step (an int64)
