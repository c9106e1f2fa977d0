"""How much of a report directory is kept: the newest journals of each scenario with their
history, page and logs (`gameday prune --keep N`). Twelve game days once made 64 MB of
`reports/`, and CI carried it all forward from night to night.

A journal goes with every file named after it (`NAME-STAMP.json`, `.history.jsonl`,
`.html`, screenshots...) and its row in the index of runs. A stack's log is not named after a
game day (one stack may serve many): it goes once it was last written before the oldest game
day kept had begun, when no kept game day can be in it. Load runs (`load-STAMP.*`) are kept
the same way, the newest N. The shared chart script, the index and anything else stay.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from harness.report import runs

LOAD_PREFIX = "load-"


@dataclass
class Pruned:
    kept: dict[str, int] = field(default_factory=dict)  # scenario → journals kept
    removed_journals: list[str] = field(default_factory=list)
    removed_files: list[Path] = field(default_factory=list)
    removed_bytes: int = 0


def prune(report_dir: Path, keep: int, dry_run: bool = False) -> Pruned:
    """Keep the newest `keep` journals of each scenario (and load runs), remove the rest."""
    if keep < 1:
        raise ValueError("keep at least 1 journal of each scenario (the gate compares with "
                         "them)")
    pruned = Pruned()
    journals: dict[str, list[tuple[str, Path]]] = {}
    for path in report_dir.glob("*.json"):
        if path.name.startswith(LOAD_PREFIX):
            journals.setdefault("gameday load", []).append((path.stem, path))
            continue
        if not runs.is_journal(path):
            continue
        try:
            journal = json.loads(path.read_text())
            scenario, started = str(journal["game_day"]), str(journal["started_at"])
        except (ValueError, KeyError, TypeError):
            continue  # not a journal: not ours to remove
        journals.setdefault(scenario, []).append((started, path))
    oldest_kept: datetime | None = None
    gone: list[Path] = []
    for scenario, dated in journals.items():
        dated.sort()
        kept, old = dated[-keep:], dated[:-keep]
        pruned.kept[scenario] = len(kept)
        for started, _ in kept:
            when = _when(started)
            if when is not None and (oldest_kept is None or when < oldest_kept):
                oldest_kept = when
        for _, path in old:
            gone.append(path)
            if scenario != "gameday load":
                pruned.removed_journals.append(path.name)
    files = [f for path in gone for f in _named_after(path)]
    if oldest_kept is not None:
        files += [log for log in report_dir.glob("*.log")
                  if log.stat().st_mtime < oldest_kept.timestamp() and log not in files]
    for f in files:
        pruned.removed_bytes += _size(f)
        pruned.removed_files.append(f)
        if dry_run:
            continue
        if f.is_dir():
            shutil.rmtree(f)
        else:
            f.unlink(missing_ok=True)
    if pruned.removed_journals and not dry_run and (report_dir / runs.INDEX).exists():
        with runs.opened(report_dir) as db:
            db.executemany("DELETE FROM runs WHERE journal = ?",
                           [(name,) for name in pruned.removed_journals])
    return pruned


def _named_after(journal: Path) -> list[Path]:
    """The journal and every file and folder named after it (its history, its page, a load
    run's CSV and samples)."""
    stem = journal.name.removesuffix(".json")
    return sorted(p for p in journal.parent.iterdir()
                  if p.name.startswith((f"{stem}.", f"{stem}_", f"{stem}-")))


def _when(started_at: str) -> datetime | None:
    try:
        when = datetime.fromisoformat(started_at)
    except ValueError:
        try:  # a load run's stamp: load-20261202T182612Z
            when = datetime.strptime(started_at.removeprefix(LOAD_PREFIX), "%Y%m%dT%H%M%S%z")
        except ValueError:
            return None
    return when if when.tzinfo else None


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size if path.exists() else 0
