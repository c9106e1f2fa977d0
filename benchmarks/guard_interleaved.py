"""The guard's cost per tool call, ours and the naive one, pass by pass in turn (issue 3).

    bash scripts/setup && .venv/bin/python -m benchmarks.guard_interleaved [--rounds 300]

pytest-benchmark (benchmarks/test_guard_overhead.py) times one guard's rounds, then the
other's: on a shared machine a change of load between the two skews the ratio either way.
Here every round times one pass of each guard over the same stream of 400 calls, in
alternating order, so drift hits both alike; the ratio of medians is the figure to quote.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.test_guard_overhead import (
    CALL_TOKENS,
    CALL_USD,
    GUARDS,
    _trips_on_a_repeat,
    make_stream,
)


def per_call_ns(guard: object, stream: list[tuple[str, dict[str, object], bool]]) -> float:
    before_call = guard.before_call  # type: ignore[attr-defined]
    after_call = guard.after_call  # type: ignore[attr-defined]
    charge = guard.charge  # type: ignore[attr-defined]
    started = time.perf_counter_ns()
    for tool, args, ok in stream:
        probe = before_call(tool, args)
        after_call(tool, ok, probe)
        charge(CALL_USD, CALL_TOKENS)
    return (time.perf_counter_ns() - started) / len(stream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--windows", type=int, nargs="+", default=[10, 50])
    args = parser.parse_args()
    stream = make_stream()
    print(f"{'window':>6} {'guard':>6} {'min µs':>8} {'median µs':>10} {'p90 µs':>8}")
    for window in args.windows:
        guards = {name: make(window) for name, make in GUARDS.items()}
        for name in GUARDS:  # both are real guards: each trips on an identical repeat
            assert _trips_on_a_repeat(GUARDS[name](window)), name
        times: dict[str, list[float]] = {name: [] for name in guards}
        for round_ in range(args.rounds + 20):
            order = list(guards) if round_ % 2 == 0 else list(reversed(guards))
            for name in order:
                ns = per_call_ns(guards[name], stream)
                if round_ >= 20:  # warm-up rounds are dropped
                    times[name].append(ns)
        for name, values in times.items():
            values.sort()
            print(f"{window:>6} {name:>6} {values[0] / 1000:>8.2f} "
                  f"{statistics.median(values) / 1000:>10.2f} "
                  f"{values[int(len(values) * 0.9)] / 1000:>8.2f}")
        ratio = statistics.median(times["ours"]) / statistics.median(times["naive"])
        print(f"{window:>6} ours/naive median ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
