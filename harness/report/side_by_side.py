"""The switches of two control planes side by side, from their game days' journals: for each
dialect and switch, the time from the switch's request to its answer and to each sandbox's
daemon exit (with the exit codes seen).

    python -m harness.report.side_by_side reports/upstream reports/own

Every kill of every journal under the folders counts: one row per dialect and switch, in
milliseconds from the operator's request (time_to_stop's samples, harness/judge/time_to_stop.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from harness.judge.checkers import KILL_DELIVERY_F

MS = 1e6


def deliveries(journal: dict[str, Any], history: list[dict[str, Any]] | None) -> None:
    """Where the control plane records its kill messages (this project's sessions), each
    sample gets when its daemon was sent the kill and when it acknowledged it, from the
    kill's request: where the time between the request and the answer goes."""
    if not history:
        return
    sent = [e["value"] for e in history if e.get("f") == KILL_DELIVERY_F]
    for s in journal["measurements"]["time_to_stop"]["samples_ns"]:
        if s["kill_index"] >= len(history):
            continue
        at = int(history[s["kill_index"]]["time_ns"])
        first = min((d for d in sent if d.get("agent_id") == s["agent_id"]
                     and int(d["sent_ns"]) >= at), key=lambda d: int(d["sent_ns"]), default=None)
        if first is not None:
            s["kill_sent_ns"] = int(first["sent_ns"]) - at
            s["kill_acked_ns"] = None if first.get("acked_ns") is None \
                else int(first["acked_ns"]) - at


def rows(journals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (dialect, server version, switch): counts, the answer's and the exits'
    least and greatest times (ms), the kill messages' where they are recorded, and the exit
    codes."""
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for j in journals:
        key = (j.get("dialect", "covey-gameday"), str(j.get("versions", {}).get("covey", "?")))
        for s in j["measurements"]["time_to_stop"]["samples_ns"]:
            grouped[(*key, s["kill_f"])].append(s)
    out = []
    for (dialect, version, switch), samples in sorted(grouped.items()):
        answers = [s["kill_acknowledged_ns"] / MS for s in samples
                   if s["kill_acknowledged_ns"] is not None]
        exits = [s["daemon_exit_ns"] / MS for s in samples if s["daemon_exit_ns"] is not None]
        out.append({"dialect": dialect, "version": version, "switch": switch,
                    "kills": len(samples), "answers": answers, "exits": exits,
                    "sent": [s["kill_sent_ns"] / MS for s in samples if "kill_sent_ns" in s],
                    "acked": [s["kill_acked_ns"] / MS for s in samples
                              if s.get("kill_acked_ns") is not None],
                    "exit_codes": sorted({s["daemon_exit_code"] for s in samples
                                          if s["daemon_exit_code"] is not None})})
    return out


def _span(values: list[float]) -> str:
    if not values:
        return "none seen"
    median = sorted(values)[len(values) // 2]
    return f"{min(values):.0f} to {max(values):.0f} ms (median {median:.0f})"


def table(found: list[dict[str, Any]]) -> str:
    lines = ["| dialect (server) | switch | kills | request → answer | request → kill sent "
             "to a daemon | request → daemon's ack | request → daemon exit | exit codes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in found:
        lines.append(f"| {r['dialect']} ({r['version']}) | {r['switch']} | {r['kills']} | "
                     f"{_span(r['answers'])} | {_span(r['sent'])} | {_span(r['acked'])} | "
                     f"{_span(r['exits'])} ({len(r['exits'])} exits) | "
                     f"{', '.join(map(str, r['exit_codes'])) or '—'} |")
    return "\n".join(lines)


def journals_under(folders: list[Path]) -> list[dict[str, Any]]:
    found = []
    for folder in folders:
        for path in sorted(folder.glob("*.json")):
            document = json.loads(path.read_text())
            if isinstance(document, dict) and "measurements" in document:
                history = path.parent / str(document.get("history", ""))
                deliveries(document, [json.loads(line) for line in history.open()]
                           if history.is_file() else None)
                found.append(document)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    journals = journals_under(args.folders)
    if not journals:
        print(f"no game-day journals under {', '.join(map(str, args.folders))}",
              file=sys.stderr)
        return 1
    print(table(rows(journals)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
