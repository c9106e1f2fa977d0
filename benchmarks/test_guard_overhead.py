"""The guard's cost per tool call, beside a naive guard's, in one run (issue 3).

    cd /work/main && /work/venv/bin/pytest benchmarks/test_guard_overhead.py --benchmark-only \
        -p no:cacheprovider

Not part of the test suite (pyproject's `testpaths` is `tests`). One measured call is what
coveyd's loop does around each tool call: `before_call(tool, args)`, `after_call(tool, ok,
probe)` and `charge(usd, tokens)`, over a stream of a few hundred pre-generated, distinct calls
with the shapes of covey/tools.py (shell, read_file, write_file with 200-2000 chars of content,
http_request), about one in eight failing, never three in a row for a tool. The stream is
longer than any loop window and no call repeats inside one, so neither guard ever trips while it
is measured: every limit is set out of reach and the kill-flag lease is renewed for a
practically endless ttl on the real monotonic clock (both guards read it once per call).

The naive guard below is the obvious implementation: SHA-256 of the JSON of the call as its
fingerprint, the window a list counted with `list.count`, a dict per tool for the breaker
(consecutive failures, open or closed, no half-open probe), a running sum of costs against the
budget and a lease expiry. Ours additionally folds whitespace, detects A,B,A,B cycles, half-opens
its breakers with one probe, checks scoped kill flags and keeps the last actions for a snapshot.
Both are checked to trip on an identical repeated call before anything is measured.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from covey.guard import Guard, KillFlag, Limits, LoopTrip, fingerprint

STREAM_LENGTH = 400  # distinct calls, cycled; far longer than any loop window below
WINDOWS = (10, 50)
ENDLESS_TTL_S = 1e12  # the lease never runs out while the benchmark runs
OUT_OF_REACH = 10**15
CALL_USD = 1e-6
CALL_TOKENS = 1_200
ROUNDS = 300  # each round is one pass over the stream, timed as a whole, reported per call
WARMUP_ROUNDS = 20

Call = tuple[str, dict[str, Any], bool]  # tool, arguments, whether the tool call succeeded


class NaiveTrip(Exception):
    """The naive guard's one exception type."""


@dataclass
class _NaiveBreaker:
    failures: int = 0
    open: bool = False


@dataclass
class NaiveGuard:
    """The comparison: what one writes first, doing less than covey.guard.Guard."""

    window: int = 10
    repeats: int = 3
    breaker_failures: int = 3
    max_cost_usd: float = 1.0
    max_tool_calls: int = 200
    clock: Callable[[], float] = time.monotonic
    expires_at: float = float("-inf")
    cost_usd: float = 0.0
    tool_calls: int = 0
    recent: list[str] = field(default_factory=list)
    breakers: dict[str, _NaiveBreaker] = field(default_factory=dict)

    def renew(self, ttl_s: float) -> None:
        self.expires_at = self.clock() + ttl_s

    def before_call(self, tool: str, args: dict[str, Any]) -> bool:
        if self.clock() > self.expires_at:
            raise NaiveTrip("lease expired")
        if self.tool_calls >= self.max_tool_calls:
            raise NaiveTrip("tool-call budget")
        breaker = self.breakers.get(tool)
        if breaker is not None and breaker.open:
            raise NaiveTrip(f"circuit open for {tool}")
        canonical = json.dumps({"tool": tool, "args": args}, sort_keys=True)
        print_ = hashlib.sha256(canonical.encode()).hexdigest()
        self.recent.append(print_)
        if len(self.recent) > self.window:
            self.recent.pop(0)
        if self.recent.count(print_) >= self.repeats:
            raise NaiveTrip(f"repeated {tool}")
        self.tool_calls += 1
        return False

    def after_call(self, tool: str, ok: bool, probe: bool = False) -> None:
        breaker = self.breakers.setdefault(tool, _NaiveBreaker())
        if ok:
            breaker.failures = 0
            breaker.open = False
            return
        breaker.failures += 1
        if breaker.failures >= self.breaker_failures:
            breaker.open = True

    def charge(self, usd: float, tokens: int = 0) -> None:
        self.cost_usd += usd
        if self.cost_usd > self.max_cost_usd:
            raise NaiveTrip("cost budget")


class _Guarded(Protocol):
    def before_call(self, tool: str, args: dict[str, Any]) -> bool: ...

    def after_call(self, tool: str, ok: bool, probe: bool = False) -> None: ...

    def charge(self, usd: float, tokens: int = 0) -> None: ...


# --- the stream of calls ------------------------------------------------------------------

_WORDS = ("self", "return", "value", "config", "result", "items", "path", "error", "client",
          "request", "response", "timeout", "retry", "session", "logger", "payload", "name")


def _source(rng: random.Random, n: int, size: int) -> str:
    """Python-looking file content of about `size` characters: indented lines, blank lines."""
    lines = [f'"""Module {n}: generated for the guard benchmark."""', "", "import json", ""]
    total = sum(len(line) + 1 for line in lines)
    depth = 0
    while total < size:
        words = rng.sample(_WORDS, 4)
        kind = rng.random()
        if kind < 0.15:
            line = f"def {words[0]}_{words[1]}_{n}({words[2]}, {words[3]}=None):"
            depth = 1
        elif kind < 0.25:
            line = ""
        else:
            line = ("    " * depth + f"{words[0]}.{words[1]} = {words[2]}.get("
                    f"'{words[3]}', {rng.randint(0, 9999)})  # {words[1]}  {words[0]}")
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines)[:size]


def make_stream(length: int = STREAM_LENGTH, seed: int = 3) -> list[Call]:
    """Distinct calls, even after whitespace folding; failures never three in a row."""
    rng = random.Random(seed)
    calls: list[Call] = []
    for n in range(length):
        kind = n % 4
        if kind == 0:
            args: dict[str, Any] = {
                "cmd": rng.choice((
                    f"grep -rn 'handler_{n}' src/ | head -n 40",
                    f"python -m pytest tests/test_mod_{n}.py -x -q  2>&1 | tail -n 30",
                    f"ls -la build/out_{n} && cat build/out_{n}/log.txt | wc -l",
                )),
                "timeout_s": rng.choice((10, 30, 60)),
            }
            tool = "shell"
        elif kind == 1:
            args = {"path": f"src/pkg/sub_{n % 7}/module_{n}.py"}
            tool = "read_file"
        elif kind == 2:
            args = {"path": f"src/pkg/sub_{n % 7}/module_{n}.py",
                    "content": _source(rng, n, rng.randint(200, 2000))}
            tool = "write_file"
        else:
            body = json.dumps({"id": n, "name": f"item-{n}", "tags": ["a", "b", f"t{n}"],
                               "note": " ".join(rng.choices(_WORDS, k=12))})
            args = {"method": rng.choice(("GET", "POST", "PUT")),
                    "url": f"https://api.example.com/v1/items/{n}?page={n % 9}&limit=50",
                    "body": body}
            tool = "http_request"
        calls.append((tool, args, rng.random() >= 0.125))
    # No tool fails three times in a row (breaker_failures stays 3, as in production).
    failures: dict[str, int] = {}
    for i, (tool, args, ok) in enumerate(calls):
        failures[tool] = 0 if ok else failures.get(tool, 0) + 1
        if failures[tool] >= 3:
            calls[i] = (tool, args, True)
            failures[tool] = 0
    return calls


# --- the guards under test ----------------------------------------------------------------


def make_ours(window: int, *, repeats: int = 3) -> Guard:
    flag = KillFlag(clock=time.monotonic, scopes=("global", "org:o1", "agent:a1"))
    flag.renew(ENDLESS_TTL_S)
    limits = Limits(max_cost_usd=float(OUT_OF_REACH), max_tokens=OUT_OF_REACH,
                    max_tool_calls=OUT_OF_REACH, max_wall_s=float(OUT_OF_REACH),
                    max_steps=OUT_OF_REACH, loop_window=window, loop_repeats=repeats,
                    breaker_failures=3)
    return Guard(limits, flag, clock=time.monotonic)


def make_naive(window: int, *, repeats: int = 3) -> NaiveGuard:
    guard = NaiveGuard(window=window, repeats=repeats, breaker_failures=3,
                       max_cost_usd=float(OUT_OF_REACH), max_tool_calls=OUT_OF_REACH)
    guard.renew(ENDLESS_TTL_S)
    return guard


GUARDS: dict[str, Callable[[int], _Guarded]] = {"ours": make_ours, "naive": make_naive}


def _trips_on_a_repeat(guard: _Guarded) -> bool:
    args = {"cmd": "rm -rf ./build", "timeout_s": 30}
    try:
        for _ in range(3):
            probe = guard.before_call("shell", dict(args))
            guard.after_call("shell", True, probe)
            guard.charge(CALL_USD, CALL_TOKENS)
    except LoopTrip:
        return True
    except NaiveTrip as trip:
        return str(trip).startswith("repeated")  # the loop check, not another limit
    return False


@pytest.fixture(scope="module")
def stream() -> list[Call]:
    calls = make_stream()
    # Distinct for both fingerprints, so no window can hold a repeat.
    assert len({fingerprint(tool, args) for tool, args, _ in calls}) == len(calls)
    assert len({json.dumps({"tool": t, "args": a}, sort_keys=True) for t, a, _ in calls}) \
        == len(calls)
    sizes = [len(args["content"]) for tool, args, _ in calls if tool == "write_file"]
    assert 200 <= min(sizes) and max(sizes) <= 2000
    # Both are real guards: an identical repeated call trips each, at any window.
    for window in WINDOWS:
        for name, make in GUARDS.items():
            assert _trips_on_a_repeat(make(window)), f"{name} did not trip at window {window}"
    return calls


def test_both_guards_trip_on_an_identical_repeated_call(stream: list[Call]) -> None:
    """Runs without --benchmark-only; with it, the `stream` fixture makes the same check."""
    for window in WINDOWS:
        assert _trips_on_a_repeat(make_ours(window))
        assert _trips_on_a_repeat(make_naive(window))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", list(GUARDS))
def test_per_tool_call(benchmark: BenchmarkFixture, stream: list[Call], name: str,
                       window: int) -> None:
    """One call: before_call + after_call + charge. A round is one pass over the stream, so
    each round's figure is the mean per call over the whole mix of calls."""
    benchmark.group = f"guard per tool call, loop window {window}"
    guard = GUARDS[name](window)
    # A full pass over the stream first: nothing trips on it (and the breakers exist).
    for tool, args, ok in stream:
        probe = guard.before_call(tool, args)
        guard.after_call(tool, ok, probe)
        guard.charge(CALL_USD, CALL_TOKENS)
    calls: Iterator[Call] = itertools.cycle(stream)
    before_call, after_call, charge = guard.before_call, guard.after_call, guard.charge

    def one_call() -> None:
        tool, args, ok = next(calls)
        probe = before_call(tool, args)
        after_call(tool, ok, probe)
        charge(CALL_USD, CALL_TOKENS)

    benchmark.pedantic(one_call, rounds=ROUNDS, iterations=len(stream),  # type: ignore[no-untyped-call]
                       warmup_rounds=WARMUP_ROUNDS)
    benchmark.extra_info.update(guard=name, window=window, calls_per_round=len(stream))


# --- where the time goes: the fingerprint alone -------------------------------------------


def _naive_fingerprint(tool: str, args: dict[str, Any]) -> str:
    canonical = json.dumps({"tool": tool, "args": args}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


@pytest.mark.parametrize("name", ["ours", "naive"])
@pytest.mark.benchmark(group="fingerprint only")
def test_fingerprint_only(benchmark: BenchmarkFixture, stream: list[Call], name: str) -> None:
    """covey.guard.fingerprint (whitespace folding, JSON, hash()) vs JSON + SHA-256."""
    print_: Callable[[str, dict[str, Any]], object] = (
        fingerprint if name == "ours" else _naive_fingerprint)
    calls: Iterator[Call] = itertools.cycle(stream)

    def one() -> None:
        tool, args, _ = next(calls)
        print_(tool, args)

    benchmark.pedantic(one, rounds=ROUNDS, iterations=len(stream),  # type: ignore[no-untyped-call]
                       warmup_rounds=WARMUP_ROUNDS)
    benchmark.extra_info.update(part="fingerprint", guard=name, calls_per_round=len(stream))
