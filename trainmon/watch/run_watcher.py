"""Following one run: its ranks, the export of each step every followed rank has committed, heatmaps,
alerts, and the state that lets a restarted daemon go on where this one stopped."""
from __future__ import annotations

import logging
import os
import pickle
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from trainmon.core.defaults import WATCH
from trainmon.core.layout import WATCHED_RUN
from trainmon.output_dir import make_output_dir
from trainmon.read.errors import InputError
from trainmon.read.layout import find_run
from trainmon.read.parallel import PARALLEL_FROM
from trainmon.watch.aggregate import StepFigures, step_figures
from trainmon.watch.alerts import AlertTracker
from trainmon.watch.chunk import OpenReaders, read_chunk
from trainmon.watch.events import ALERT_TAG, WatchEvents
from trainmon.watch.follow import RankFollower
from trainmon.watch.heatmap import pictures
from trainmon.watch.history import History
from trainmon.watch.state import load_state, save_state
from trainmon.watch.view import MAX_RUN, GroupRoles, View, ViewOptions, layout
from trainmon.watch.workers import WorkerPool

logger = logging.getLogger("trainmon.watch")
HEATMAP_DIR = "heatmaps"
HEATMAP_TAG = "heatmaps"
# Steps read per rank at once: memory is ranks x tags x this, never the run's length. A finished run is read in
# longer chunks where there are few ranks (each read of a rank has a fixed cost of ~1.5 ms), up to
# CHUNK_RANK_STEPS rank-steps a chunk.
CHUNK_STEPS = 16
CHUNK_RANK_STEPS = 1 << 14
MAX_CHUNK_STEPS = 64
TAGS_WARNING = 500  # tags a step from which TensorBoard's dashboards take seconds to answer


def read_figures(followers: list[RankFollower], first: int, last: int, ranks_kept: frozenset = frozenset(),
                 on_error: Optional[Callable[[RankFollower, Exception], None]] = None,
                 spread: Optional[tuple] = None, readers: Optional[OpenReaders] = None) -> dict[int, StepFigures]:
    """The figures of steps first..last of the followed ranks, by step, read in this process.

    Args:
        on_error: called for a rank that cannot be read (then left out), and for each of its files that cannot be
            read whole (the rest of the rank is read); None lets the error through.
        readers: where the ranks' readers are kept open (default: each opened for this read and closed).

    Raises:
        InputError: a rank or one of its files cannot be read and `on_error` is None.
    """
    chunks = [read_chunk((f.rank_dir, f.source, first, last, f.rank in ranks_kept), readers) for f in followers]
    read = []
    for follower, chunk in zip(followers, chunks):
        for error in [chunk.error] if chunk.error is not None else chunk.unread:
            if on_error is None:
                raise error
            on_error(follower, error)
        if chunk.error is None:
            read.append(chunk)
    return step_figures(read, ranks_kept, spread)


# the readers of a worker process that reads spans of a finished run (`--once`), kept from one span to the next
_SPAN_READERS = OpenReaders()


def figures_of_span(task: tuple) -> tuple[dict[int, StepFigures], list[tuple[int, str]]]:
    """(followers, first, last, ranks_kept, drawn, spread) -> (`read_figures` of those steps, (rank, why) of what
    could not be read and was left out), in a worker process: the values of every rank (`StepFigures.rows`)
    are kept only for the steps a layer x rank heatmap may be drawn at (the last one, those in `drawn`, and the
    first holding a NaN/Inf, which may be the incident), so that what comes back is small."""
    followers, first, last, ranks_kept, drawn, spread = task
    errors = []
    figures = read_figures(followers, first, last, ranks_kept, lambda f, err: errors.append((f.rank, str(err))),
                           spread, _SPAN_READERS)
    first_bad = min((step for step, figure in figures.items() if figure.worst is not None), default=None)
    for step, figure in figures.items():
        if step != last and step not in drawn and step != first_bad:
            figure.rows = None
    return figures, errors


def _ahead(pool: WorkerPool, function: Callable, tasks: list, depth: int) -> Iterator:
    """`function` over `tasks` in the pool, in order, with at most `depth` tasks running or done ahead of
    the caller: memory stays bounded however many tasks there are."""
    pending: deque = deque()
    for task in tasks:
        pending.append(pool.submit(function, task))
        if len(pending) > depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


@dataclass
class WatchOptions:
    """The daemon's settings (the `trainmon watch` flags)."""

    logdir: Optional[Path] = None
    interval: float = WATCH.interval
    once: bool = False
    ranks: frozenset = frozenset()
    on_anomaly: Optional[str] = None
    exit_on_anomaly: bool = False
    stall_after: float = WATCH.stall_after
    heatmap_every: Optional[int] = None  # None: every WATCH.heatmap_every steps live; with `once`, only at exit
    op: str = WATCH.op
    window: int = WATCH.window
    source: str = WATCH.source
    detail: tuple = ()  # regexes of the tensors that get charts of their own

    def redraws_at(self, step: int) -> bool:
        """Whether the heatmaps are redrawn after exporting `step` (besides the drawing at exit). A finished
        run (`once`) is drawn once: matplotlib takes seconds a drawing, more than the export of 50 steps."""
        every = self.heatmap_every or (None if self.once else WATCH.heatmap_every)
        return every is not None and (step + 1) % every == 0


class RunWatcher:
    """Exports one run into `logdir`.

    Args:
        run: the run directory.
        logdir: the output directory (created).
        options: the daemon's settings.

    Raises:
        InputError: `logdir` cannot be created or written, or its state file cannot be read.
    """

    def __init__(self, run: Path, logdir: Path, options: WatchOptions):
        self.run, self.logdir, self.options = run, logdir, options
        make_output_dir(logdir)
        state = load_state(logdir)
        self.exported: int = state.get("exported", -1)
        self.drawn_at: Optional[int] = state.get("drawn_at")
        self.events = WatchEvents(logdir / MAX_RUN, state.get("events"))
        self.layout_keys = {tuple(k) for k in state.get("layout", [])}  # the selected tensors' (family, name, vpp, op)
        self.scalar_names = set(state.get("scalar_names", []))
        self.families = set(state.get("families", []))
        self.view: Optional[View] = None  # made once the ranks are known: their number and groups shape it
        self._view_state = state.get("view")
        # the sibling runs of MAX_RUN (the layers' spread over ranks, their NaN/Inf elements), made when first written
        self.siblings: dict[str, WatchEvents] = {}
        self._siblings_state = state.get("siblings", {})
        self._warned_size = False
        self._saved_layout = self._layout_state()  # what the state file holds of them, made when they grow
        self.alerts = AlertTracker(run, logdir, lambda step, text: self.events.text(step, ALERT_TAG, text),
                                   options.on_anomaly, state.get("alerts"))
        self.history = History(options.op, options.window)
        self.followers: dict[int, RankFollower] = {}
        self.missing_ranks: list[int] = []
        self.unread: dict[int, list[str]] = {}  # rank -> why parts of it (a file, a line) were left out of the view
        self._refill = self.exported >= 0  # a restarted daemon rebuilds its heatmap window first
        self._painter: Optional[WorkerPool] = None  # draws the heatmaps beside the export
        self._readers: Optional[WorkerPool] = None  # read the ranks (--once over many ranks)
        self._drawing: Optional[tuple[int, Future]] = None  # (step, pictures being drawn)
        # a draw that an earlier daemon started and never wrote (killed): drawn again after the restart
        self._redraw: Optional[int] = state.get("drawing")

    # ------------------------------------------------------------------------------- following
    def _discover(self) -> None:
        try:
            found = find_run(self.run)
        except InputError:
            if self.options.once:
                raise  # a finished run without output: nothing will come
            return  # no rank has written anything yet
        if self.options.once:
            found.only(self.options.ranks)  # a --rank the finished run lacks is bad input
        if found.missing_ranks != self.missing_ranks:  # said again only when it changes (ranks start one by one)
            self.missing_ranks = found.missing_ranks
            if found.missing_warning:
                logger.warning("trainmon watch: warning: %s", found.missing_warning)
        for rank_dir in found.ranks:
            if rank_dir.rank not in self.followers:
                self.followers[rank_dir.rank] = RankFollower(rank_dir, self.options.source)

    def poll(self, final: bool = False) -> list[dict]:
        """One round: reads every rank's progress, exports the complete steps, looks for anomalies.
        Returns the alerts written. `final`: the run is over, every step present is complete."""
        self._discover()
        readable = self._poll_followers(final)
        alerts = self.alerts.poll(readable)  # first: an alert must not wait for a long export
        if alerts and self.options.exit_on_anomaly:
            self._save()
            return alerts  # the daemon exits now; a restart exports the rest
        last = self._frontier(readable)
        if last is not None and last > self.exported:
            if self._refill:
                self._refill_history()
            if self._redraw is not None:
                self.draw(self._redraw)
                self._redraw = None
            self._export(self.exported + 1, last, readable)
            if not final:  # the steps committed during the export go now, not an interval later
                readable = self._poll_followers(final)
                last = self._frontier(readable)
                if last is not None and last > self.exported:
                    self._export(self.exported + 1, last, readable)
        alerts += self.alerts.poll(readable)  # what the export found in ranks without a database
        self._collect_pictures(wait=False)
        self._save()
        return alerts

    def check_stalls(self) -> None:
        """Between rounds: the ranks whose stall is due are read again, and said to have stalled if they still
        have not committed, at once rather than at the next round."""
        due = [f for f in self.followers.values() if f.stall_due(self.options.stall_after)]
        if due:
            self._poll_followers(False, due)

    def _poll_followers(self, final: bool, followers: Optional[list[RankFollower]] = None) -> list[RankFollower]:
        """Reads the progress of `followers` (default: every rank), saying once when one stalls or cannot be
        read; returns every readable rank."""
        for follower in self.followers.values() if followers is None else followers:
            message = follower.poll(final)
            if message is None and not final:
                message = follower.check_stall(self.options.stall_after)
            if message:
                logger.warning("trainmon watch: %s: %s", self.run.name, message)
        return [f for f in self.followers.values() if f.error is None]

    def unreadable(self) -> dict[int, str]:
        """{rank: why} of the ranks that cannot be read, or only in part."""
        out = {rank: "; ".join(why) for rank, why in self.unread.items()}
        out.update({f.rank: f.error or "; ".join(f.lost) for f in self.followers.values()
                    if f.error is not None or f.lost})
        return out

    def _left_out_of(self, follower: RankFollower, err: Exception) -> None:
        self._left_out(follower.rank, str(err))

    def _left_out(self, rank: int, why: str) -> None:
        """Says once per cause that steps of `rank` could not be read (they stay out of the view)."""
        said = self.unread.setdefault(rank, [])
        if why not in said:
            said.append(why)
            logger.warning("trainmon watch: %s: rank %s: %s; left out of the view, the rest goes on", self.run.name,
                           rank, why)

    @staticmethod
    def _frontier(readable: list[RankFollower]) -> Optional[int]:
        """The last step to export: one that every rank still writing has completed. A stalled rank is not
        waited for (its steps so far are read); when every rank has stalled, all they committed is exported."""
        writing = [f.complete_through for f in readable if not f.stalled]
        if writing:
            return None if None in writing else min(writing)
        return max((f.complete_through for f in readable if f.complete_through is not None), default=None)

    @property
    def done(self) -> bool:
        """Every rank finished and everything is exported."""
        return bool(self.followers) and all(f.finished and (f.latest is None or f.latest <= self.exported)
                                            for f in self.followers.values() if f.error is None)

    # --------------------------------------------------------------------------------- export
    def _figures(self, first: int, last: int, followers: list[RankFollower]) -> Iterator[tuple[int, dict]]:
        """(last step, figures by step) of each chunk of steps first..last. For `--once` over many ranks
        the chunks are read and reduced across ranks in worker processes, a few chunks ahead of the export:
        that is most of the export's work, and a finished run has all its steps there. (A live daemon reads a
        few steps a poll, in this process.)"""
        ranks, spread = self.options.ranks, self._spread()
        if not self.options.once or len(followers) < PARALLEL_FROM:
            for start in range(first, last + 1, CHUNK_STEPS):
                end = min(last, start + CHUNK_STEPS - 1)
                yield end, read_figures(followers, start, end, ranks, self._left_out_of, spread)
            return
        size = max(CHUNK_STEPS, min(MAX_CHUNK_STEPS, CHUNK_RANK_STEPS // len(followers)))
        spans = [(start, min(last, start + size - 1)) for start in range(first, last + 1, size)]
        workers = os.cpu_count() or 1
        if self._readers is None:
            self._readers = WorkerPool(workers)
        tasks = [(followers, start, end, ranks, {s for s in range(start, end + 1) if self.options.redraws_at(s)},
                  spread) for start, end in spans]
        for (_, end), (figures, errors) in zip(spans, _ahead(self._readers, figures_of_span, tasks, workers + 1)):
            for rank, why in errors:
                self._left_out(rank, why)
            yield end, figures

    def _spread(self) -> Optional[tuple]:
        """What `step_figures` needs for the layers' spread over ranks: none with one rank (or no view yet)."""
        if self.view is None or self.view.options.single_rank:
            return None
        return self.view.options.op, self.view.options.layer

    def _make_view(self) -> View:
        """The view of this run: with its roles of process groups and whether it has one rank. A restarted
        daemon makes the same, from the same ranks."""
        metadata = []
        for follower in self.followers.values():
            try:
                metadata.append(follower.rank_dir.metadata())
            except (InputError, OSError, ValueError):
                continue  # that rank's run.json is unreadable: its groups are named by size
        world = max([len(self.followers)] + [int(m.get("world_size") or 0) for m in metadata])
        return View(ViewOptions(op=self.options.op, detail=tuple(self.options.detail), single_rank=world == 1,
                                roles=GroupRoles(metadata)), self._view_state)

    def _export(self, first: int, last: int, followers: list[RankFollower]) -> None:
        if self.view is None:
            self.view = self._make_view()
        stalled = sum(f.stalled for f in self.followers.values())
        for end, figures in self._figures(first, last, followers):
            for step in sorted(figures):
                figure = figures[step]
                tags = self.view.tags(figure, stalled)
                self._check_size(len(tags.scalars))
                self.events.scalars(step, tags.scalars)
                for run, values in tags.siblings.items():
                    self._sibling(run).scalars(step, values)
                for tag, text in tags.texts:
                    self.events.text(step, tag, text)
                self.history.add(figure)
                if figure.nonfinite:
                    self.alerts.note_step(step)
                self._grow_layout(figure)
                if self.options.redraws_at(step):
                    self.draw(step)
            self.exported = end

    def _sibling(self, run: str) -> WatchEvents:
        """The event file of a sibling run, `<logdir>/<run>/`, resumed where an earlier daemon left it."""
        if run not in self.siblings:
            self.siblings[run] = WatchEvents(self.logdir / run, self._siblings_state.get(run))
        return self.siblings[run]

    def _check_size(self, tags: int) -> None:
        """Says once when --detail or --ranks make the view larger than TensorBoard serves quickly (its pages
        fetch one tag a request: about 10 ms a tag at 1,000 steps, benchmarks/README.md)."""
        if tags > TAGS_WARNING and not self._warned_size:
            self._warned_size = True
            logger.warning("trainmon watch: %s: the view holds %d tags a step; TensorBoard's pages take seconds "
                           "from about %d on: narrow --detail or --ranks", self.run.name, tags, TAGS_WARNING)

    def _grow_layout(self, figure: StepFigures) -> None:
        keys = set()  # the tensors that get charts of their own: none without a --detail to match
        if self.options.detail:
            keys = {key for key in figure.stats if self.view.options.selected(key[1])} - self.layout_keys
        names = set(figure.scalar_series()) - self.scalar_names
        families = {key[0] for key in figure.stats} - self.families
        if keys or names or families:
            self.layout_keys |= keys
            self.scalar_names |= names
            self.families |= families
            options = self.view.options
            self.events.layout(layout(self.scalar_names, self.families, options.op, options.single_rank,
                                      self.layout_keys))
            self._saved_layout = self._layout_state()

    def _refill_history(self) -> None:
        self._refill = False
        first = max(0, self.exported - self.options.window + 1)
        followers = [f for f in self.followers.values() if f.error is None]
        incident = ((self._view_state or {}).get("headline") or {}).get("incident")
        if incident and incident[0] < first:  # the layer x rank heatmaps stay at the incident
            for _, figures in self._figures(incident[0], incident[0], followers):
                for figure in figures.values():
                    self.history.keep_incident(figure)
        for _, figures in self._figures(first, self.exported, followers):
            for step in sorted(figures):
                self.history.add(figures[step])

    # ------------------------------------------------------------------------------- heatmaps
    def draw(self, step: int, wait: bool = False) -> None:
        """Draws every heatmap of the window as of `step`, in a worker process so that the export goes on
        meanwhile (matplotlib takes about 0.5 s a picture); the pictures are written when they are ready,
        into TensorBoard at `step` and into `heatmaps/*.png`. A redraw due while one is running waits for it.

        Args:
            wait: wait for the pictures (at exit).
        """
        self._collect_pictures(wait=True)
        alert = self.alerts.current
        if self._painter is None:
            self._painter = WorkerPool(1)
        # pickled now: the export goes on changing the history while the painter draws
        snapshot = pickle.dumps((self.history, alert["first"] if alert else None))
        self._drawing = (step, self._painter.submit(_paint, snapshot))
        self._collect_pictures(wait=wait)

    def _collect_pictures(self, wait: bool) -> None:
        if self._drawing is None or not (wait or self._drawing[1].done()):
            return
        step, future = self._drawing
        self._drawing = None
        drawn = future.result()
        if not drawn:
            return
        folder = self.logdir / HEATMAP_DIR
        folder.mkdir(exist_ok=True)
        for picture in drawn:
            temporary = folder / f".{picture.name}.png"
            temporary.write_bytes(picture.png)
            temporary.replace(folder / f"{picture.name}.png")
        self.events.images(step, [(f"{HEATMAP_TAG}/{p.name}", p.png, p.height, p.width) for p in drawn])
        self.drawn_at = step

    # ---------------------------------------------------------------------------------- state
    def _save(self) -> None:
        save_state(self.logdir, {WATCHED_RUN: str(self.run.resolve()), "exported": self.exported,
                                 "drawn_at": self.drawn_at,
                                 "drawing": self._drawing[0] if self._drawing else self._redraw,
                                 "events": self.events.checkpoint(), "alerts": self.alerts.state(),
                                 "view": self.view.state() if self.view else self._view_state,
                                 "missing_ranks": self.missing_ranks,
                                 "siblings": {**self._siblings_state, **{run: events.checkpoint() for run, events in
                                                                         self.siblings.items()}},
                                 **self._saved_layout})

    def _layout_state(self) -> dict:
        return {"layout": sorted(list(k) for k in self.layout_keys), "scalar_names": sorted(self.scalar_names),
                "families": sorted(self.families)}

    def finish(self, draw: bool = True) -> None:
        """Draws the heatmaps of the last step exported (when not drawn yet), saves the state, closes.

        Args:
            draw: False: an exit that must not wait (--exit-on-anomaly); a drawing under way is dropped, and
                the state file keeps its step, so a restarted daemon draws it.
        """
        if draw:
            self._collect_pictures(wait=True)
            if self.exported >= 0 and self.drawn_at != self.exported:
                if self._refill:  # a restart with nothing left to export: the window is read again for the draw
                    self._refill_history()
                self.draw(self.exported, wait=True)
        for pool in (self._painter, self._readers):
            if pool is None:
                continue
            if draw:
                pool.shutdown()
            else:
                pool.kill()
        self._save()
        self.events.close()
        for events in self.siblings.values():
            events.close()


def _paint(snapshot: bytes) -> list:
    """The heatmaps of a pickled (history, place of the first anomaly)."""
    return pictures(*pickle.loads(snapshot))
