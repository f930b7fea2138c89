"""The pack: one zip per rank of JSON members. A job's packs sit in one directory as `rank_<R>.zip`; the
command-line capture writes one zip without a rank."""
from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from trainmon.read.errors import InputError

FORMAT = "trainmon-config-check"
VERSION = 1
# The members a pack may hold besides meta.json; a capture writes those it has.
MEMBERS = ("environment", "packages", "hyperparameters", "weights", "dataset", "random")


@dataclass
class Pack:
    """One rank's record (rank None: a capture made outside a job)."""

    path: Path
    rank: Optional[int]
    members: dict[str, Any] = field(default_factory=dict)


def rank_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank_{rank}.zip"


def write_pack(path: str | os.PathLike, rank: Optional[int], world_size: int, members: dict[str, Any]) -> Path:
    """Writes `members` to the zip at `path` (through a temporary file, so a reader never sees half a pack)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("meta.json", json.dumps({"format": FORMAT, "version": VERSION, "rank": rank,
                                                  "world_size": world_size}))
        for name, value in members.items():
            archive.writestr(f"{name}.json", json.dumps(value, indent=1, default=str))
    os.replace(partial, path)
    return path


def _read_zip(path: Path) -> Pack:
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            if "meta.json" not in names:
                raise InputError.at(path, "not a config-check pack (no meta.json)")
            meta = json.loads(archive.read("meta.json"))
            if meta.get("format") != FORMAT:
                raise InputError.at(path, f"not a config-check pack (format {meta.get('format')!r})")
            members = {name: json.loads(archive.read(f"{name}.json")) for name in MEMBERS if f"{name}.json" in names}
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise InputError.at(path, f"not a readable zip file ({err})") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSON errors are ValueErrors
        if isinstance(err, InputError):
            raise
        raise InputError.at(path, f"a member is not valid JSON ({err})") from None
    return Pack(path, meta.get("rank"), members)


def read_packs(path: str | os.PathLike) -> dict[Optional[int], Pack]:
    """{rank: pack} of a pack file or of a directory of `rank_<R>.zip` packs."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("rank_*.zip"))
        if not files:
            raise InputError.at(path, "no rank_<R>.zip packs in this directory")
        packs = [_read_zip(f) for f in files]
    elif path.exists():
        packs = [_read_zip(path)]
    else:
        raise InputError.at(path, "no such file or directory")
    return {pack.rank: pack for pack in packs}
