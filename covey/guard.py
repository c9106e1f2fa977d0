"""The guard around every tool call of an agent (DESIGN §2.4). Code, not prompt.

Each layer raises a typed `Trip` naming the layer and a reason a human can act on. The guard
is synchronous and allocation-light: it runs before every step and every tool call.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Clock = Callable[[], float]


class Trip(Exception):
    """The agent must stop at the next safe boundary."""

    layer = "guard"

    def __init__(self, reason: str, **detail: Any) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


class BudgetTrip(Trip):
    layer = "budget"


class StepLimitTrip(Trip):
    layer = "steps"


class LoopTrip(Trip):
    layer = "loop"


class CircuitOpenTrip(Trip):
    layer = "circuit_breaker"


class KillFlagTrip(Trip):
    layer = "kill_flag"


class LeaseExpiredTrip(KillFlagTrip):
    """The flag store could not be asked in time: fail closed."""


class ToolStoppedTrip(KillFlagTrip):
    """One tool is stopped by a tool-scoped flag: this call is refused, the agent goes on
    with its other tools (the daemon answers the model with the refusal)."""


@dataclass(frozen=True)
class Limits:
    max_cost_usd: float = 1.0
    max_tokens: int = 200_000
    # One model call: the completion it may ask for when the budgets allow, and the least
    # worth asking for (below it an answer cannot even hold one tool call, so the call is
    # refused instead of sent).
    max_completion_tokens: int = 4096
    min_completion_tokens: int = 64
    max_tool_calls: int = 200
    max_wall_s: float = 600.0
    max_steps: int = 50
    loop_window: int = 10
    loop_repeats: int = 3  # identical calls within the window that trip
    cycle_max_period: int = 3  # A,B,A,B is period 2
    cycle_repeats: int = 2  # how many full periods in a row trip
    breaker_failures: int = 3
    breaker_cooldown_s: float = 30.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Limits:
        known = {k: config[k] for k in cls.__dataclass_fields__ if k in config}
        return cls(**known)


def _canonical(value: Any) -> Any:
    """A hashable form of a call's arguments, the same up to key order and whitespace runs.

    Hashing this tuple directly costs a fraction of serialising JSON and hashing the text,
    which is what the guard's benchmark compares against (benchmarks/test_guard_overhead.py).
    """
    if isinstance(value, str):
        return " ".join(value.split())
    if isinstance(value, dict):
        return ("{", *sorted((str(k), _canonical(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return ("[", *(_canonical(v) for v in value))
    if value is None or isinstance(value, bool | int | float):
        return (type(value).__name__, value)  # True, 1 and 1.0 hash alike; keep them apart
    return ("?", repr(value))


def fingerprint(tool: str, args: Mapping[str, Any]) -> int:
    """Same tool, same arguments up to key order and whitespace: same fingerprint. Python
    salts string hashes per process: fingerprints compare within one daemon, never across."""
    return hash((tool, _canonical(args)))


class LoopDetector:
    """Identical calls in a sliding window, and short cycles (A,B,A,B)."""

    def __init__(self, limits: Limits) -> None:
        self.window = limits.loop_window
        self.repeats = limits.loop_repeats
        self.max_period = limits.cycle_max_period
        self.cycle_repeats = limits.cycle_repeats
        self._recent: deque[int] = deque()
        self._counts: dict[int, int] = {}
        self._tools: deque[str] = deque()

    def observe(self, tool: str, print_: int) -> None:
        """Record a call about to be made; trip if it closes a loop."""
        counts = self._counts
        self._recent.append(print_)
        self._tools.append(tool)
        seen = counts.get(print_, 0) + 1
        counts[print_] = seen
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            self._tools.popleft()
            left = counts[old] - 1
            if left:
                counts[old] = left
            else:
                del counts[old]
            if old == print_:
                seen -= 1
        if seen >= self.repeats:
            raise LoopTrip(
                f"repeated {tool} {seen} times with identical arguments",
                tool=tool, repeats=seen, window=self.window)
        self._check_cycles()

    def _check_cycles(self) -> None:
        recent = self._recent
        n = len(recent)
        for period in range(2, self.max_period + 1):
            span = period * self.cycle_repeats
            if n < span:
                return
            if recent[-1] != recent[-1 - period]:
                continue  # most calls end here: not even the last one repeats
            # The last `span` calls repeat with this period, and the period is not a
            # shorter one repeated (which the identical-call check handles).
            if all(recent[n - 1 - i] == recent[n - 1 - i - period]
                   for i in range(span - period)):
                tail = [recent[n - period + j] for j in range(period)]
                if len(set(tail)) > 1:
                    tools = [self._tools[n - period + j] for j in range(period)]
                    raise LoopTrip(
                        f"cycled through {', '.join(tools)} {self.cycle_repeats} times",
                        cycle=tools, repeats=self.cycle_repeats)


@dataclass
class _Breaker:
    state: str = "closed"  # closed | open | half_open
    failures: int = 0
    opened_at: float = 0.0
    probe_in_flight: bool = False


class CircuitBreakers:
    """Per tool: closed → open after N consecutive failures → half-open after the cooldown,
    when exactly one probe may pass; its outcome closes or reopens the circuit."""

    def __init__(self, limits: Limits, clock: Clock) -> None:
        self.failures = limits.breaker_failures
        self.cooldown = limits.breaker_cooldown_s
        self.clock = clock
        self._breakers: dict[str, _Breaker] = {}

    def state(self, tool: str) -> str:
        b = self._breakers.get(tool)
        return b.state if b else "closed"

    def admit(self, tool: str) -> bool:
        """May this call go through? Returns True when it is the half-open probe."""
        b = self._breakers.get(tool)
        if b is None or b.state == "closed":
            return False
        if b.state == "open":
            waited = self.clock() - b.opened_at
            if waited < self.cooldown:
                raise CircuitOpenTrip(
                    f"{tool} failed {b.failures} times in a row; circuit open for another "
                    f"{self.cooldown - waited:.1f}s", tool=tool, failures=b.failures)
            b.state = "half_open"
        if b.probe_in_flight:
            raise CircuitOpenTrip(f"{tool} is half-open and its one probe is in flight",
                                  tool=tool)
        b.probe_in_flight = True
        return True

    def record(self, tool: str, ok: bool, probe: bool) -> None:
        b = self._breakers.setdefault(tool, _Breaker())
        if probe:
            b.probe_in_flight = False
        if ok:
            b.state, b.failures = "closed", 0
            return
        b.failures += 1
        if probe or b.failures >= self.failures:
            b.state, b.opened_at = "open", self.clock()


@dataclass
class KillFlag:
    """The out-of-band flag: a lease the control plane renews, and stopped scopes.

    Scopes are "global", "org:<id>", "agent:<id>" and "tool:<name>". Before the first renewal
    and after the lease runs out, every check fails: the flag fails closed.
    """

    clock: Clock = time.monotonic
    scopes: tuple[str, ...] = ("global",)
    expires_at: float = float("-inf")
    stopped: set[str] = field(default_factory=set)

    def renew(self, ttl_s: float, stopped: set[str] | None = None) -> None:
        self.expires_at = self.clock() + ttl_s
        if stopped is not None:
            self.stopped = set(stopped)

    def stop(self, scope: str) -> None:
        self.stopped.add(scope)

    def check(self, tool: str | None = None) -> None:
        now = self.clock()
        if now > self.expires_at:
            late = now - self.expires_at
            raise LeaseExpiredTrip(
                "kill-flag lease not renewed: flag store unreachable"
                + ("" if math.isinf(late) else f" for {late * 1000:.0f} ms past expiry"),
                failing_closed=True)
        if not self.stopped:  # the common case, checked before every step and call
            return
        for scope in self.scopes:
            if scope in self.stopped:
                raise KillFlagTrip(f"kill flag set for {scope}", scope=scope)
        if tool is not None and f"tool:{tool}" in self.stopped:
            raise ToolStoppedTrip(f"kill flag set for tool {tool}", scope=f"tool:{tool}")


# Bytes, not tokens, as the prompt's size: a tokenizer library (tiktoken) fetches its
# encodings from the network on first use, which a sandbox may not reach, and knows only
# OpenAI's models. Every token of a byte-level BPE vocabulary (OpenAI's, Llama's, Mistral's)
# stands for at least one byte of the text, so the UTF-8 size of the request's messages and
# tool schemas, all JSON punctuation included, is an upper bound of the prompt's tokens; the
# margin covers the few tokens a chat template adds that are not in the request (roles,
# separators, the reply's priming). About four times the real count for English: the
# reservation is conservative, the prompt is usually the cheap part of a call.
PROMPT_MARGIN_TOKENS = 64


def prompt_token_bound(messages: Any, tools: Any = None) -> int:
    """At least as many tokens as the prompt of a chat request with these messages and
    tools can count (see PROMPT_MARGIN_TOKENS for why bytes)."""
    text = json.dumps({"messages": messages, "tools": tools}, ensure_ascii=False)
    return len(text.encode()) + PROMPT_MARGIN_TOKENS


@dataclass(frozen=True)
class Reservation:
    """What one model call may cost at most, decided before it is sent."""

    model: str
    price: tuple[float, float]  # USD per million tokens: prompt, completion
    prompt_tokens: int  # the bound of the prompt's tokens (prompt_token_bound)
    max_tokens: int  # the completion it is allowed: what it asks the endpoint for

    @property
    def worst_usd(self) -> float:
        return (self.prompt_tokens * self.price[0] + self.max_tokens * self.price[1]) / 1e6

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "prompt_tokens_bound": self.prompt_tokens,
                "max_tokens": self.max_tokens, "worst_usd": round(self.worst_usd, 9)}


@dataclass(frozen=True)
class Usage:
    """What one model call did cost, as its endpoint reported it."""

    prompt_tokens: int
    completion_tokens: int
    usd: float

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Action:
    tool: str
    args: Mapping[str, Any]
    ok: bool | None = None


class Guard:
    """All layers, in the order a step meets them."""

    def __init__(self, limits: Limits, flag: KillFlag, clock: Clock = time.monotonic,
                 prices: Mapping[str, tuple[float, float]] | None = None) -> None:
        self.limits = limits
        self.flag = flag
        self.clock = clock
        self.prices = dict(prices or {})
        self.started = clock()
        self.steps = 0
        self.tool_calls = 0
        self.cost_usd = 0.0
        self.tokens = 0
        self.loops = LoopDetector(limits)
        self.breakers = CircuitBreakers(limits, clock)
        self.history: deque[Action] = deque(maxlen=10)

    def before_step(self) -> None:
        self.flag.check()
        elapsed = self.clock() - self.started
        if elapsed > self.limits.max_wall_s:
            raise BudgetTrip(f"ran {elapsed:.0f}s, over the {self.limits.max_wall_s:.0f}s "
                             "wall-clock budget", elapsed_s=elapsed)
        if self.steps >= self.limits.max_steps:
            raise StepLimitTrip(f"reached the step limit of {self.limits.max_steps}",
                                steps=self.steps)
        self.steps += 1

    def before_call(self, tool: str, args: Mapping[str, Any]) -> bool:
        """Admit one tool call or trip. Returns whether it is a half-open probe (pass it
        back to after_call)."""
        self.flag.check(tool)
        if self.tool_calls >= self.limits.max_tool_calls:
            raise BudgetTrip(f"made {self.tool_calls} tool calls, the budget is "
                             f"{self.limits.max_tool_calls}", tool_calls=self.tool_calls)
        self.loops.observe(tool, fingerprint(tool, args))
        probe = self.breakers.admit(tool)
        self.tool_calls += 1
        self.history.append(Action(tool, args))
        return probe

    def after_call(self, tool: str, ok: bool, probe: bool = False) -> None:
        if self.history and self.history[-1].tool == tool:
            self.history[-1].ok = ok
        self.breakers.record(tool, ok, probe)

    def price_of(self, model: str) -> tuple[float, float]:
        """The model's price (USD per million tokens, prompt and completion). Unknown prices
        are not free, nor are NaN, infinite or negative ones."""
        price = self.prices.get(model)
        if price is None:
            raise BudgetTrip(f"model {model!r} has no known price; refusing to spend blind",
                             model=model)
        if not all(isinstance(p, int | float) and math.isfinite(p) and p >= 0 for p in price):
            raise BudgetTrip(f"model {model!r} has the unusable price {price!r} per million "
                             "tokens; refusing to spend blind", model=model)
        return price

    def reserve(self, model: str, prompt_tokens: int) -> Reservation:
        """Admit one model call before it is sent, or trip. The completion it is allowed
        is what the remaining dollar and token budgets pay for, with its prompt counted at
        `prompt_tokens` (an upper bound): a call can then not take the spend past a cap
        unless its endpoint answers more than it was allowed (which `book` trips on)."""
        price = self.price_of(model)
        limits = self.limits
        left_usd = limits.max_cost_usd - self.cost_usd
        left_tokens = limits.max_tokens - self.tokens
        prompt_usd = prompt_tokens * price[0] / 1e6
        allowed = min(limits.max_completion_tokens, left_tokens - prompt_tokens)
        if price[1] > 0:
            # Rounded down, and a hair under, so that the sum of floats never lands a
            # nano-dollar past the cap.
            paid = math.floor((left_usd - prompt_usd) * 1e6 / price[1] * (1 - 1e-12))
            allowed = min(allowed, paid)
        elif prompt_usd > left_usd:
            allowed = -1
        least = limits.min_completion_tokens
        if allowed < least:
            worst_usd = (prompt_tokens * price[0] + least * price[1]) / 1e6
            detail = {"model": model, "prompt_tokens_bound": prompt_tokens,
                      "min_completion_tokens": least, "worst_usd": worst_usd,
                      "remaining_usd": left_usd, "remaining_tokens": left_tokens}
            if left_tokens - prompt_tokens < least:
                raise BudgetTrip(
                    f"{max(left_tokens, 0)} tokens left of the {limits.max_tokens} token "
                    f"budget do not cover this call's worst case of {prompt_tokens + least} "
                    f"tokens (a prompt of at most {prompt_tokens} and {least} completion "
                    "tokens); refused before sending", **detail)
            raise BudgetTrip(
                f"${max(left_usd, 0):.4f} left of the ${limits.max_cost_usd:.4f} budget "
                f"does not pay for this call's worst case ${worst_usd:.4f} (a prompt of "
                f"at most {prompt_tokens} tokens and {least} completion tokens); refused "
                "before sending", **detail)
        return Reservation(model, price, prompt_tokens, allowed)

    def price_usage(self, reservation: Reservation, prompt_tokens: Any,
                    completion_tokens: Any) -> Usage:
        """A call's reported usage at its model's price; unusable counts trip."""
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in (prompt_tokens, completion_tokens)):
            raise BudgetTrip(f"model reported unusable token counts {prompt_tokens!r}/"
                             f"{completion_tokens!r}", model=reservation.model)
        price = reservation.price
        usd = (prompt_tokens * price[0] + completion_tokens * price[1]) / 1_000_000
        return Usage(prompt_tokens, completion_tokens, usd)

    def book(self, reservation: Reservation, usage: Usage) -> None:
        """Count what a call did cost. An endpoint that answered more than the call was
        allowed has broken the reservation: the ceiling cannot be kept with it, so it trips
        at once, whatever is left of the budget."""
        self.charge(usage.usd, usage.tokens, check=False)
        if usage.completion_tokens > reservation.max_tokens:
            raise BudgetTrip(
                f"the model endpoint answered {usage.completion_tokens} completion tokens, "
                f"more than the {reservation.max_tokens} it was allowed; spent "
                f"${self.cost_usd:.4f} of the ${self.limits.max_cost_usd:.4f} budget",
                model=reservation.model, allowed=reservation.max_tokens,
                completion_tokens=usage.completion_tokens, cost=self.cost_usd)
        self._check_budgets()

    def charge_usage(self, model: str, prompt_tokens: Any, completion_tokens: Any) -> float:
        """Price a model call from its reported usage and count it (no reservation)."""
        reservation = Reservation(model, self.price_of(model), 0, 0)
        usage = self.price_usage(reservation, prompt_tokens, completion_tokens)
        self.charge(usage.usd, usage.tokens)
        return usage.usd

    def charge(self, usd: float, tokens: int = 0, check: bool = True) -> None:
        if not isinstance(usd, int | float) or not math.isfinite(usd) or usd < 0:
            raise BudgetTrip(f"cost {usd!r} is not a finite, non-negative amount", cost=usd)
        if not isinstance(tokens, int) or tokens < 0:
            raise BudgetTrip(f"token count {tokens!r} is not a non-negative integer")
        self.cost_usd += usd
        self.tokens += tokens
        if check:
            self._check_budgets()

    def _check_budgets(self) -> None:
        if self.cost_usd > self.limits.max_cost_usd:
            raise BudgetTrip(f"spent ${self.cost_usd:.4f}, over the "
                             f"${self.limits.max_cost_usd:.4f} budget", cost=self.cost_usd)
        if self.tokens > self.limits.max_tokens:
            raise BudgetTrip(f"used {self.tokens} tokens, over the {self.limits.max_tokens} "
                             "token budget", tokens=self.tokens)

    def snapshot(self, trip: Trip) -> dict[str, Any]:
        """What a human needs to act on a trip."""
        return {
            "layer": trip.layer,
            "reason": trip.reason,
            "detail": trip.detail,
            "cost_usd": round(self.cost_usd, 6),
            "tokens": self.tokens,
            "steps": self.steps,
            "tool_calls": self.tool_calls,
            "last_actions": [{"tool": a.tool, "args": dict(a.args), "ok": a.ok}
                             for a in self.history],
        }
