"""The game day's page: its size and the time to render it, for game days of 5, 20 and 50
agents, beside the time to write the journal and history it is rendered from (what every
game day paid before it had a page), in one run.

    .venv/bin/python -m benchmarks.report_page [--repeat 5]

The game days are specimens (harness/report/specimen.py): the same history every run, each
agent acting every 200 ms for ten seconds around a fleet stop and a fault.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.kill_latency import machine
from harness.report.page import write_page
from harness.report.specimen import specimen_game_day


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--agents", type=int, nargs="+", default=[5, 20, 50])
    options = parser.parse_args()
    print(json.dumps(machine()))
    print(f"{'agents':>6} {'events':>7} {'page KiB':>9} {'render ms':>10} "
          f"{'journal+history KiB':>20} {'write ms':>9} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as folder:
        for agents in options.agents:
            journal, history = specimen_game_day(agents)
            path = Path(folder) / f"specimen-{agents}.json"
            writes, renders = [], []
            for _ in range(options.repeat):
                start = time.perf_counter()
                history.to_jsonl(path.with_suffix(".history.jsonl"))
                journal["history"] = path.with_suffix(".history.jsonl").name
                path.write_text(json.dumps(journal, indent=2))
                writes.append(time.perf_counter() - start)
                start = time.perf_counter()
                page = write_page(path)
                renders.append(time.perf_counter() - start)
            written = path.stat().st_size + path.with_suffix(".history.jsonl").stat().st_size
            write_ms = statistics.median(writes) * 1000
            render_ms = statistics.median(renders) * 1000
            print(f"{agents:>6} {len(history):>7} {page.stat().st_size / 1024:>9.0f} "
                  f"{render_ms:>10.1f} {written / 1024:>20.0f} {write_ms:>9.1f} "
                  f"{render_ms / write_ms:>5.1f}x")


if __name__ == "__main__":
    main()
