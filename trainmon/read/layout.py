"""Where a run's files are: run discovery, rank directories, the files of a rank.

trainmon writes `<run>/rank_<R>/`; msprobe writes `<Mon DD_HH-MM-SS>-rank<R>-<uuid8>/` under its output
root. Both hold `<family>_<first>-<last>.csv` files with the same columns; trainmon's also hold
`monitor.db` (or, on a network filesystem, `records.stream`), `anomalies.jsonl` and `run.json`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Optional

from trainmon.core.layout import ANOMALIES_FILE, DB_NAME, FAMILY_FILE, RANK_DIR, RUN_JSON, STREAM_NAME
from trainmon.core.records import FAMILIES
from trainmon.read import stream_mirror
from trainmon.read.errors import InputError



@dataclass(frozen=True)
class FamilyFile:
    """One `<family>_<first>-<last>.csv` file: the records of one family over a range of steps."""

    family: str
    first: int
    last: int
    path: Path

    def overlaps(self, first: Optional[int], last: Optional[int]) -> bool:
        return (first is None or self.last >= first) and (last is None or self.first <= last)


@dataclass(frozen=True)
class RankDir:
    """One rank's directory and the sources it holds."""

    rank: int
    path: Path

    @property
    def db(self) -> Optional[Path]:
        """monitor.db; without one, the rank's record stream as a database (`stream_mirror`), brought up to date.

        Raises:
            InputError, OSError: the record stream cannot be read.
        """
        path = self.path / DB_NAME
        if path.is_file():
            return path
        if self.stream is None:
            return None
        return stream_mirror.sync(self.stream, self.jsonl)

    def stream_findings(self) -> Optional[stream_mirror.Findings]:
        """What reading the rank's record stream found besides whole frames (None: the rank's records are not
        read from a stream).

        Raises:
            InputError, OSError: the record stream cannot be read.
        """
        db = self.db
        return stream_mirror.findings(self.stream) if db is not None and stream_mirror.is_mirror(db) else None

    @property
    def stream(self) -> Optional[Path]:
        """records.stream: what the `db` format writes on a network filesystem."""
        path = self.path / STREAM_NAME
        return path if path.is_file() else None

    @property
    def jsonl(self) -> Optional[Path]:
        path = self.path / ANOMALIES_FILE
        return path if path.is_file() else None

    def family_files(self, family: Optional[str] = None) -> list[FamilyFile]:
        """The CSV files of one family (or all), ordered by first step, then family."""
        files = []
        for path in self.path.glob("*.csv"):
            match = FAMILY_FILE.match(path.name)
            if match and match["family"] in FAMILIES and family in (None, match["family"]):
                files.append(FamilyFile(match["family"], int(match["first"]), int(match["last"]), path))
        return sorted(files, key=lambda f: (f.first, f.family))

    def metadata(self) -> dict:
        """The rank's `run.json` ({} when it has none).

        Raises:
            InputError: run.json is there but is not a JSON object.
        """
        path = self.path / RUN_JSON
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise InputError.at(path, f"not a readable {RUN_JSON} ({err})") from None
        if not isinstance(data, dict):
            raise InputError.at(path, f"not a {RUN_JSON} (expected a JSON object)")
        return data


@dataclass(frozen=True)
class RunDirs:
    """A run found on disk: its directory, its ranks, and a note on how it was chosen (or None)."""

    path: Path
    ranks: list[RankDir]
    note: Optional[str] = None

    def only(self, ranks: Optional[Iterable[int]]) -> list[RankDir]:
        """The directories of `ranks` (all for None), for a command's `--rank`.

        Raises:
            InputError: one of `ranks` is not a rank of the run (naming the ranks it has).
        """
        if ranks is None:
            return self.ranks
        wanted = set(ranks)
        missing = sorted(wanted - {d.rank for d in self.ranks})
        if missing:
            raise InputError.at(self.path, f"has no rank {', '.join(map(str, missing))} (ranks: "
                                           f"{_listed([d.rank for d in self.ranks])})")
        return [d for d in self.ranks if d.rank in wanted]

    def stream_findings(self, ranks: Optional[Iterable[int]] = None) -> list[stream_mirror.Findings]:
        """What reading the record streams of `ranks` (all for None) found besides whole frames, one per rank
        read from a stream.

        Raises:
            InputError: a stream cannot be read, or one of `ranks` is not a rank of the run.
        """
        return [found for rank_dir in self.only(ranks) if (found := rank_dir.stream_findings()) is not None]

    @cached_property
    def missing_ranks(self) -> list[int]:
        """The ranks of the run that have no directory with output: those below the highest rank found, and
        below the world size run.json records. [] for one rank's directory given on its own."""
        if not self.ranks or self.ranks[0].path == self.path:
            return []
        found = {rank_dir.rank for rank_dir in self.ranks}
        expected = max(_world_size(self.ranks[0]), self.ranks[-1].rank + 1)
        return [rank for rank in range(expected) if rank not in found]

    @property
    def missing_warning(self) -> Optional[str]:
        """One line naming the missing ranks (None when none is)."""
        if not self.missing_ranks:
            return None
        expected = len(self.ranks) + len(self.missing_ranks)
        return (f"{self.path}: rank(s) {', '.join(map(str, self.missing_ranks))} of {expected} missing (no rank_<R> "
                f"directory with output); the results cover the other {len(self.ranks)}. Copy the missing "
                "directories in, or check whether those ranks failed before their first step")


def find_run(path: str | Path) -> RunDirs:
    """The run at `path`: a run directory, one rank directory, msprobe's output root (holding
    `*-rank<R>-*` directories), or an output root holding runs (the latest is taken, with a note).

    Raises:
        InputError: `path` is missing, holds no monitor output, or two directories claim one rank.
    """
    root = Path(path)
    if not root.is_dir():
        raise InputError.at(root, "no such directory; pass a run directory ($MONITOR_OUTPUT_DIR/<run>), the "
                                  "output root, or msprobe's output directory", None)
    ranks = _rank_dirs(root)
    if ranks:
        return RunDirs(root, ranks)
    if _has_output(root):
        return RunDirs(root, [RankDir(_rank_from_metadata(root), root)])
    runs = sorted((child for child in root.iterdir() if child.is_dir() and _rank_dirs(child)),
                  key=lambda child: (child.stat().st_mtime, child.name))
    if not runs:
        raise InputError.at(root, "no rank_<R> directories here or one level below, and no monitor output "
                                  "(monitor.db, records.stream, <family>_<a>-<b>.csv); pass a run directory "
                                  "($MONITOR_OUTPUT_DIR/<run>), the output root, or an msprobe dump directory "
                                  "(step<N>/rank<R>/dump.json)")
    note = None if len(runs) == 1 else (f"{len(runs)} runs under {root}; reading the latest, {runs[-1].name} "
                                        f"(pass its directory to choose another)")
    return RunDirs(runs[-1], _rank_dirs(runs[-1]), note)


def _rank_dirs(root: Path) -> list[RankDir]:
    ranks: dict[int, Path] = {}
    for child in root.iterdir():
        match = RANK_DIR.search(child.name)
        if not match or not child.is_dir() or not _has_output(child):
            continue
        rank = int(match[1] if match[1] is not None else match[2])
        if rank in ranks:
            raise InputError.at(root, f"{ranks[rank]} and {child} both hold rank {rank}; this directory mixes "
                                      "several runs, give one run's directory")
        ranks[rank] = child
    return [RankDir(rank, ranks[rank]) for rank in sorted(ranks)]


def _listed(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 16 else "")


def _world_size(rank_dir: RankDir) -> int:
    """The world size one rank's run.json records (0: not known; every rank records the same)."""
    try:
        size = rank_dir.metadata().get("world_size", 0)
    except InputError:
        return 0  # the commands that read run.json report it
    return size if isinstance(size, int) else 0


def _has_output(d: Path) -> bool:
    rank = RankDir(0, d)
    return (d / DB_NAME).is_file() or rank.stream is not None or rank.jsonl is not None or bool(rank.family_files())


def _rank_from_metadata(d: Path) -> int:
    """The rank of a directory whose name does not say it (a rank directory given on its own)."""
    rank = RankDir(0, d).metadata().get("rank", 0)
    return rank if isinstance(rank, int) else 0
