"""coveyd: the sandbox daemon (DESIGN §2.4).

It dials out to the control plane, says `ready`, and works the tasks it is given with a
tool-calling loop against an OpenAI-compatible chat-completions endpoint, every tool call
passing through the guard. Exit codes: 0 clean sleep, 1 error, 2 stopped by its own guard,
3 kill switch (a `kill` message, or the kill-flag lease running out: fail closed).

Why it stopped is said twice more, because exit code 3 alone cannot tell an obeyed `kill`
from a lease that ran out (a daemon deaf to `kill` once looked exactly like one that obeyed):
in its last message to the control plane (`kill_ack` for an obeyed kill, `stopping` for every
other way out, as far as the channel still carries it) and in its exit log line.

Whatever way it stops, the tool call under way is cut first (covey.tools, `Toolbox.cut`):
every process the tools started is dead before the daemon says it stopped, and that last
message names the call it cut. An `rm -rf` started a moment before the kill must not outlive
the acknowledgement the operator is answered with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets
from websockets.asyncio.client import ClientConnection

from covey import __version__
from covey.config import DAEMON_DEFAULT_MODEL_URL
from covey.guard import (
    Guard,
    KillFlag,
    LeaseExpiredTrip,
    Limits,
    ToolStoppedTrip,
    Trip,
    prompt_token_bound,
)
from covey.tools import SCHEMAS, RunningTool, Toolbox, ToolCut, become_subreaper

log = logging.getLogger("coveyd")

EXIT_SLEEP, EXIT_ERROR, EXIT_TRIPPED, EXIT_KILLED = 0, 1, 2, 3
# How long a stopping daemon waits for its cancelled run to end before it exits anyway.
WORK_END_S = 1.0
# How far below the priority it started at a daemon whose kill is confirmed goes for its
# exit, in a crowd (step_aside).
STEP_ASIDE_NICE = 10
# The priority this daemon started at, read as it is imported: before the plane can raise it.
STARTED_NICE = os.getpriority(os.PRIO_PROCESS, 0)
# The close codes with which the control plane refuses a daemon (covey.api.daemon: protocol
# error, bad token, another sandbox's token): the daemon's own error, not the plane's loss.
REFUSED = frozenset({4400, 4401, 4403})
# How long the last word may hold up the exit: the channel may be the very thing that is cut.
LAST_WORD_S = 0.2
# Each model request carries when the daemon sent it, in nanoseconds of the wall clock
# (CLOCK_REALTIME). A model endpoint stamps a request when its handler runs, which under
# load trails the send by whatever its event loop was busy with; only the sender can say
# whether a request left before or after the daemon acknowledged its kill (`acked_ns` in
# `kill_ack`, the same clock). Processes on one host share that clock, and containers share
# their host's (Docker gives them no clock of their own), so the harness can set both beside
# the control plane's times; across hosts they are as close as the hosts' clocks.
SENT_AT_HEADER = "X-Covey-Sent-At-Ns"
# A task's result is cut here as the control plane cuts it (covey.protocol.MAX_RESULT_CHARS,
# not imported: the daemon does without the plane's modules): a model's longer answer would
# otherwise pass the protocol's frame limit, and a refused result leaves its task in progress.
MAX_RESULT_CHARS = 100_000

# USD per million tokens (prompt, completion). A model missing here trips the budget layer.
DEFAULT_PRICES: dict[str, tuple[float, float]] = {
    "puppet": (1.0, 2.0),
    "gpt-4o-mini": (0.15, 0.60),
    "gpt-4o": (2.50, 10.00),
}

# Where coveyd asks when COVEY_MODEL_URL is not set: a local Ollama's OpenAI-compatible API
# (`covey serve` warns at start that it will).
DEFAULT_MODEL_URL = DAEMON_DEFAULT_MODEL_URL
# Answers of the model endpoint worth asking again: rate limited, or the server's own trouble
# (and no answer at all). Any other 4xx (a mistyped model name, a bad key) is the same on
# every try: the task is blocked with the endpoint's own words, not retried.
RETRIED_STATUSES = frozenset({408, 429})
BACKOFF_CAP_S = 30.0
# The longest a kill's `hold` stands, whatever it says (see `hold_seconds`).
HOLD_CAP_S = 60.0
# Before each step the daemon gives its loop this many turns to read what the control plane
# has already sent (`read_up`). Each turn polls the sockets and reads up to 256 KiB of each
# (asyncio's selector loop); a frame waiting on the socket reached the reader in the second on
# websockets 17 (tests/test_kill_hold.py fails with one), and six leave room for more hops.
READ_UP_TURNS = 6

SYSTEM_PROMPT = (
    "You are an agent working one task in a sandbox. Use the tools; call finish with the "
    "result when the task is done."
)


class DaemonError(Exception):
    """A failure that ends the daemon with exit code 1 and this message."""


class ModelError(Exception):
    """The model endpoint refused a call (a 4xx other than a rate limit), or still failed
    after its retries: the task is blocked with this, and the session ends saying it."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def retried(status: int) -> bool:
    return status in RETRIED_STATUSES or status >= 500


def endpoint_message(response: httpx.Response) -> str:
    """What the endpoint said, in the error shapes OpenAI-compatible servers use."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict):
            error = error.get("message", error)
        return str(error)[:300]
    return str(body)[:300]


@dataclass
class Env:
    ws_url: str
    token: str
    agent_id: str
    sandbox_id: str
    model_url: str
    model_key: str
    prices: dict[str, tuple[float, float]]
    home: Path
    # The request field that carries the completion cap: `max_tokens`, or
    # `max_completion_tokens` for endpoints that want that (OpenAI's reasoning models).
    max_tokens_field: str = "max_tokens"
    model_retries: int = 4
    model_backoff_s: float = 0.5

    @classmethod
    def load(cls) -> Env:
        missing = [k for k in ("COVEY_WS_URL", "COVEY_DAEMON_TOKEN", "COVEY_AGENT_ID")
                   if not os.environ.get(k)]
        if missing:
            raise DaemonError(f"missing environment: {', '.join(missing)}")
        prices = model_prices(os.environ.get("COVEY_MODEL_PRICES"))
        field_name = os.environ.get("COVEY_MODEL_MAX_TOKENS_FIELD") or "max_tokens"
        if field_name not in ("max_tokens", "max_completion_tokens"):
            raise DaemonError(f"COVEY_MODEL_MAX_TOKENS_FIELD={field_name!r}: use max_tokens or "
                              "max_completion_tokens")
        try:
            retries = int(os.environ.get("COVEY_MODEL_RETRIES") or 4)
            backoff_ms = int(os.environ.get("COVEY_MODEL_BACKOFF_MS") or 500)
        except ValueError as exc:
            raise DaemonError(f"COVEY_MODEL_RETRIES and COVEY_MODEL_BACKOFF_MS are whole "
                              f"numbers: {exc}") from None
        return cls(
            ws_url=os.environ["COVEY_WS_URL"],
            token=os.environ["COVEY_DAEMON_TOKEN"],
            agent_id=os.environ["COVEY_AGENT_ID"],
            sandbox_id=os.environ.get("COVEY_SANDBOX_ID", ""),
            model_url=(os.environ.get("COVEY_MODEL_URL") or DEFAULT_MODEL_URL).rstrip("/"),
            model_key=os.environ.get("COVEY_MODEL_API_KEY", "none"),
            prices=prices,
            home=Path(os.environ.get("HOME", ".")).resolve(),
            max_tokens_field=field_name,
            model_retries=max(0, retries),
            model_backoff_s=max(0, backoff_ms) / 1000,
        )


def model_prices(raw: str | None) -> dict[str, tuple[float, float]]:
    """DEFAULT_PRICES with COVEY_MODEL_PRICES over them: a JSON object of model name to
    [USD per million prompt tokens, USD per million completion tokens]."""
    prices = dict(DEFAULT_PRICES)
    if not raw:
        return prices
    try:
        table = json.loads(raw)
        if not isinstance(table, dict):
            raise TypeError("not an object")
        for model, pair in table.items():
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError(f"{model!r}: give [prompt, completion]")
            prices[model] = (float(pair[0]), float(pair[1]))
    except (ValueError, TypeError) as exc:
        raise DaemonError(f"COVEY_MODEL_PRICES is not {{model: [prompt, completion]}} in USD "
                          f"per million tokens: {exc}") from None
    return prices


STOP_WORDS = {"kill": "obeyed a kill message", "lease": "its kill-flag lease ran out",
              "guard": "its own guard tripped", "sleep": "told to sleep", "error": "an error"}


@dataclass(frozen=True)
class Stop:
    """Why the daemon stopped: `kill` (it obeyed a kill message), `lease` (its kill-flag
    lease ran out: fail closed), `guard` (its own guard tripped), `sleep` (told to sleep),
    `error` (anything else)."""

    kind: str
    exit_code: int
    detail: str

    def payload(self) -> dict[str, Any]:
        return {"stop": self.kind, "exit_code": self.exit_code, "detail": self.detail[:300]}

    def sentence(self) -> str:
        return f"{STOP_WORDS[self.kind]}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class Outcome:
    result: str | None = None
    trip: Trip | None = None
    model_error: ModelError | None = None


@dataclass
class Daemon:
    env: Env
    ws: ClientConnection
    http: httpx.AsyncClient
    flag: KillFlag = field(default_factory=KillFlag)
    config: dict[str, Any] = field(default_factory=dict)
    work: asyncio.Task[None] | None = None
    guard_state: dict[str, Any] = field(default_factory=dict)
    # The model endpoint's refusal that blocked the last task: the session ends saying it.
    model_error: ModelError | None = None
    # What this session's tasks have spent so far (USD, tokens): the budget is the session's,
    # not each task's, or a session of many tasks could spend the budget many times.
    spent: tuple[float, int] = (0.0, 0)
    # Set by a kill or a lapsed lease: the run may not take another step, whatever became
    # of the cancellation sent to it (see `halt_if_stopped`).
    halted: bool = False
    # Kills on their way (the control plane's `hold`s, sent before each kill's flag
    # commits), by the hold's id: until when (monotonic) each stands. No model request or
    # tool call starts while one stands (see `wait_while_held`): until the `kill`, the
    # hold's `release`, or its end. One kill's release leaves another's hold standing.
    holds: dict[str, float] = field(default_factory=dict)
    holds_changed: asyncio.Event = field(default_factory=asyncio.Event)
    stopped: asyncio.Future[Stop] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    toolbox: Toolbox = field(init=False)
    # The call the stop struck (`stop_work`), and what the cut of the tools ended.
    struck: RunningTool | None = None
    cut: ToolCut | None = None

    def __post_init__(self) -> None:
        self.toolbox = Toolbox(self.env.home, self.http)

    async def send(self, kind: str, payload: dict[str, Any]) -> None:
        await self.ws.send(json.dumps({"type": kind, "payload": payload}, default=str))

    def finish(self, kind: str, code: int, detail: str = "") -> None:
        """The first way out wins: a kill that arrives while the daemon is falling asleep
        does not rewrite why it stopped."""
        if not self.stopped.done():
            self.stopped.set_result(Stop(kind, code, detail))

    def stop_work(self, why: str) -> None:
        """Stop at once: no safe boundary, no report. The command under way is struck
        first (its process group SIGKILLed, here and now: the cancellation reaches the run
        only when the loop next gets to it); `cut_tools` finishes the job."""
        if not self.halted:
            self.struck = self.toolbox.cut_now()
        self.halted = True
        if self.work is not None:
            self.work.cancel()
        log.warning("kill switch: %s", why)
        log.warning("daemon terminates immediately")

    async def cut_tools(self) -> ToolCut:
        """End every process the tools started and say what was cut (once)."""
        if self.cut is None:
            if not self.halted:  # a stop of another kind: nothing more may start either
                self.struck = self.toolbox.cut_now()
                self.halted = True
                if self.work is not None:
                    self.work.cancel()
            self.cut = await self.toolbox.cut(self.struck)
            if self.cut.tool is not None or self.cut.processes_killed:
                log.warning("tool call cut: %s after %.0f ms, %d process(es) killed%s",
                            self.cut.tool or "none under way", self.cut.ran_ms or 0,
                            self.cut.processes_killed,
                            "" if self.cut.all_gone else "; some survived SIGKILL")
        return self.cut

    def lease_lapsed(self, why: str) -> None:
        self.stop_work(why)
        self.finish("lease", EXIT_KILLED, why)

    async def read(self) -> None:
        try:
            await self._read()
        except websockets.ConnectionClosed:
            pass  # said by channel_lost, below
        if not self.stopped.done():
            self.channel_lost()

    def channel_lost(self) -> None:
        """The control channel ended without a kill or a sleep. Refused by the control plane
        (a bad token, a protocol error): an error of this daemon's. Otherwise the plane is
        gone (crashed, its database away): nobody can renew the lease or send a kill any
        more, so the daemon fails closed at once, its tool call cut, as a lapsed lease does.
        A game day SIGKILLed the plane under a working fleet: the daemons exited 1
        ("ConnectionClosedError"), and their last model requests arrived up to 70 ms after
        the plane had died."""
        code, reason = self.ws.close_code, self.ws.close_reason
        if code in REFUSED:
            self.finish("error", EXIT_ERROR, f"refused by the control plane ({code}"
                        f"{': ' + reason if reason else ''})")
            return
        how = ("dropped without a closing handshake" if code in (None, 1006) else
               f"closed by the control plane ({code}{': ' + reason if reason else ''})")
        self.lease_lapsed(f"control channel {how}: the lease cannot be renewed nor a kill "
                          "heard; failing closed")

    async def _read(self) -> None:
        async for raw in self.ws:
            try:
                message = json.loads(raw)
                kind, payload = message["type"], message.get("payload") or {}
            except (ValueError, KeyError, TypeError):
                log.error("unreadable message from the control plane: %.200s", raw)
                continue
            if kind == "kill":
                reason = str(payload.get("reason", "?"))
                self.stop_work(f"reason {reason}")
                stop = Stop("kill", EXIT_KILLED, f"reason {reason}")
                cut = await self.cut_tools()
                # Confirmed once nothing more can start and nothing the tools started is
                # left: the control plane answers the operator when the kill is in hand
                # here. The ack is this daemon's last word, with when it was given (no model
                # request may be sent after it) and what it cut.
                with contextlib.suppress(websockets.ConnectionClosed, TimeoutError):
                    await asyncio.wait_for(self.send("kill_ack", {
                        **stop.payload(), "acked_ns": time.time_ns(),
                        "cut": cut.payload()}), 1.0)
                if in_a_crowd(payload):
                    step_aside()
                self.finish(stop.kind, stop.exit_code, stop.detail)
                return
            if kind == "sleep":
                log.info("told to sleep%s", f" ({payload['reason']})" if "reason" in payload
                         else "")
                if payload.get("reason") == "guard-trip":
                    self.finish("guard", EXIT_TRIPPED, f"{self.guard_state.get('layer', '?')}: "
                                f"{self.guard_state.get('reason', '')}")
                elif payload.get("reason") == "model-error" and self.model_error is not None:
                    self.finish("error", EXIT_ERROR, self.model_error.message)
                else:
                    self.finish("sleep", EXIT_SLEEP, str(payload.get("reason", "")))
                return
            if kind == "hold":
                hold_id = str(payload.get("id", ""))
                self.holds[hold_id] = time.monotonic() + hold_seconds(payload.get("ttl_ms"))
                self.holds_changed.set()
                log.warning("held: a kill is on its way (%s); nothing starts until it comes",
                            payload.get("reason", "?"))
            elif kind == "release":
                if self.holds.pop(str(payload.get("id", "")), None) is not None:
                    log.warning("released: the kill that held this daemon did not stop it")
                    self.holds_changed.set()
            elif kind == "lease":
                before = set(self.flag.stopped)
                self.flag.renew(float(payload.get("ttl_ms", 0)) / 1000,
                                set(payload.get("stopped", [])))
                if self.flag.stopped != before:
                    # From here on the guard refuses what is stopped: the ground truth
                    # for "no call of that tool after the flag was in hand".
                    log.warning("kill-flag scopes now stopped: %s",
                                ", ".join(sorted(self.flag.stopped)) or "none")
                    await self.send("event", {"kind": "kill_flag", "status": "acknowledged",
                                              "detail": {"stopped": sorted(self.flag.stopped)}})
            elif kind == "inject_config":
                self.config = payload
                self.spent = (0.0, 0)  # a new session
            elif kind == "assign_task":
                if self.work is not None and not self.work.done():
                    log.error("assign_task while a task is running; ignored")
                    continue
                self.work = asyncio.create_task(self.run_task(payload))
                self.work.add_done_callback(self.on_task_end)
            elif kind == "error":
                log.warning("control plane says: %s (%s)", payload.get("error"),
                            payload.get("hint"))

    async def heartbeat(self, every_s: float = 5.0) -> None:
        while not self.stopped.done():
            try:
                await self.send("heartbeat",
                                {"busy": self.work is not None and not self.work.done()})
            except websockets.ConnectionClosed:
                return  # the reader sees the close and decides the exit
            await asyncio.sleep(every_s)

    def on_task_end(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if isinstance(exc, websockets.ConnectionClosed):  # a report the channel did not take
            self.channel_lost()
            return
        text = str(exc) if isinstance(exc, DaemonError) else repr(exc)
        log.error("%s", text)
        self.finish("error", EXIT_ERROR, text)

    async def watch_lease(self) -> None:
        """The flag fails closed even while a tool call blocks the loop's own checks.
        Idle between tasks there is nothing to stop; the next step checks the flag first."""
        while not self.stopped.done():
            try:
                if self.work is not None and not self.work.done():
                    self.flag.check()
            except LeaseExpiredTrip as trip:
                self.lease_lapsed(f"{trip.reason}; failing closed")
                return
            await asyncio.sleep(0.05)

    async def run_task(self, task: dict[str, Any]) -> None:
        outcome = await self.engine(task)
        ids = {"task_id": task["task_id"], "fencing_token": task["fencing_token"]}
        if outcome.trip is not None:
            await self.send("blocked", {**ids, "reason": outcome.trip.reason,
                                        "trip": self.guard_state})
        elif outcome.model_error is not None:
            # Blocked, not failed: what the endpoint refused (a model name, a key) is
            # mended outside the task, after which a human reopens it. The control plane
            # ends the session instead of handing out the next task to the same refusal.
            error = self.model_error = outcome.model_error
            log.error("%s", error.message)
            await self.send("blocked", {**ids, "reason": error.message, "model_error": {
                "status": error.status, "message": error.message}})
        else:
            await self.send("task_done", {**ids,
                                          "result": (outcome.result or "")[:MAX_RESULT_CHARS]})

    def make_guard(self) -> Guard:
        limits = dict(self.config.get("guard") or {})
        limits.setdefault("max_cost_usd", float(self.config.get("budget_usd", 1.0)))
        limits.setdefault("max_steps", int(self.config.get("max_turns", 20)))
        self.flag.scopes = ("global", f"org:{self.config.get('org_id', '')}",
                            f"agent:{self.env.agent_id}")
        guard = Guard(Limits.from_config(limits), self.flag, prices=self.env.prices)
        guard.cost_usd, guard.tokens = self.spent
        return guard

    async def read_up(self) -> None:
        """Let the reader have every frame the control plane has already sent. A step
        that follows another (a tool's result, then the model request) can start before
        the loop has turned to the channel: in three of four incident-load game days,
        daemons sent a model request 1-32 ms after the plane had sent their kill's
        `hold`, and read the hold only after it; in one that was an agent's second action
        after the operator's request. A few turns of the loop each step."""
        for _ in range(READ_UP_TURNS):
            await asyncio.sleep(0)

    async def wait_while_held(self) -> None:
        """Start nothing while a kill holds this daemon: its `kill` cancels the run here;
        the run goes on once no hold stands, each released or ended (said in the log).
        What the plane has sent is read first (`read_up`), and the kill flag is looked at
        last: what was read may have stopped this agent, or the wait outlived its lease
        (the guard's trips, raised here as its own look would)."""
        await self.read_up()
        while self.holds:
            self.halt_if_stopped()  # a kill whose cancellation a wait_for swallowed
            now = time.monotonic()
            for hold_id, until in list(self.holds.items()):
                if until <= now:
                    del self.holds[hold_id]
                    log.warning("a hold ran out without a kill or a release")
            if not self.holds:
                break
            self.holds_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.holds_changed.wait(),
                                       min(self.holds.values()) - now)
        self.halt_if_stopped()
        self.flag.check()

    def halt_if_stopped(self) -> None:
        """A stopped run ends here, before its next model request or tool call. Cancelling
        it is not enough on Python 3.11: a cancellation that lands just as the awaited
        call completes is swallowed by `asyncio.wait_for` (the shell tool's), which returns
        the result instead; the run went on, and under Locust load such a daemon outlived
        its kill's grace and was SIGKILLed (exit -9)."""
        if self.halted:
            raise asyncio.CancelledError

    async def engine(self, task: dict[str, Any]) -> Outcome:
        guard = self.make_guard()
        model = str(self.config.get("model", "puppet"))
        toolbox = self.toolbox
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{task.get('title', '')}\n\n{task.get('body', '')}"},
        ]
        try:
            while True:
                await self.wait_while_held()  # and `chat` looks again just before it sends
                guard.before_step()
                # Reserved before it is sent: the call may ask for no more completion than
                # what is left of the budgets pays for (the ceiling is kept, not alerted on).
                reservation = guard.reserve(model, prompt_token_bound(messages, SCHEMAS))
                reply = await self.chat(model, messages, reservation.max_tokens)
                usage = reply.get("usage") or {}
                spent = guard.price_usage(reservation, usage.get("prompt_tokens"),
                                          usage.get("completion_tokens"))
                # Recorded before it is judged: a call that broke the budget was still paid.
                await self.send("cost", {"usd": spent.usd, "tokens": spent.tokens})
                guard.book(reservation, spent)
                message = reply["choices"][0]["message"]
                messages.append(message)
                calls = message.get("tool_calls") or []
                if not calls:
                    return Outcome(result=message.get("content") or "")
                for call in calls:
                    name = call["function"]["name"]
                    try:
                        args = json.loads(call["function"].get("arguments") or "{}")
                        if not isinstance(args, dict):
                            raise ValueError("arguments must be an object")
                    except ValueError as exc:
                        messages.append({"role": "tool", "tool_call_id": call["id"],
                                         "content": json.dumps({"error": f"bad arguments: "
                                                                         f"{exc}"})})
                        continue
                    # Waited out before the guard's look: a stopped tool that the wait reads
                    # must be refused, not run after its stop was acknowledged. `finish` as
                    # well: a task does not report itself done with a kill on its way.
                    await self.wait_while_held()
                    try:
                        probe = guard.before_call(name, args)
                    except ToolStoppedTrip as refused:
                        # A stopped tool is refused, not the agent: the model hears why and
                        # may go on with its other tools.
                        await self.send("event", {"kind": "tool", "status": "refused",
                                                  "detail": {"tool": name,
                                                             "reason": refused.reason}})
                        messages.append({"role": "tool", "tool_call_id": call["id"],
                                         "content": json.dumps({"error": refused.reason})})
                        continue
                    if name == "finish":
                        guard.after_call(name, True, probe)
                        return Outcome(result=str(args.get("result", "")))
                    result, ok = await toolbox.run(name, args)
                    guard.after_call(name, ok, probe)
                    await self.send("event", {"kind": "tool", "status": "ok" if ok else "failed",
                                              "detail": {"tool": name, "args": args}})
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": json.dumps(result)})
        except LeaseExpiredTrip as trip:
            self.lease_lapsed(f"{trip.reason}; failing closed")  # cancels this very task
            raise asyncio.CancelledError from trip
        except ModelError as error:
            return Outcome(model_error=error)
        except Trip as trip:
            self.guard_state = guard.snapshot(trip)
            log.warning("guard tripped: %s: %s", trip.layer, trip.reason)
            return Outcome(trip=trip)
        finally:
            self.spent = (guard.cost_usd, guard.tokens)

    async def chat(self, model: str, messages: list[dict[str, Any]], max_tokens: int
                   ) -> dict[str, Any]:
        """One chat completion. A rate limit, a server error or no answer at all is asked
        again after a growing pause (each retry an event on the recording); any other
        refusal at once, and the last failure once the retries are spent, is a ModelError
        with the endpoint's status and words."""
        url = f"{self.env.model_url}/chat/completions"
        body = {"model": model, "messages": messages, "tools": SCHEMAS,
                self.env.max_tokens_field: max_tokens}
        attempt = 0
        while True:
            retry_after: float | None = None
            # Built (its body encoded) before the last look at the channel, so that from
            # that look to the wire there is as little as can be: a daemon starved of CPU
            # can lose it anywhere on that way. In the incident-load game day, most likely
            # so, some sent a request 14-32 ms after their kill's hold had been sent.
            request = self.http.build_request(
                "POST", url, headers={"Authorization": f"Bearer {self.env.model_key}",
                                      "X-Covey-Agent": self.env.agent_id},
                json=body, timeout=120)
            # A kill (during a retry's pause too) ends the run here; a hold keeps it back.
            await self.wait_while_held()
            # Stamped as late as this daemon can: from here to the wire there is only the
            # HTTP client, and a kill that arrives meanwhile cancels the request unsent.
            request.headers[SENT_AT_HEADER] = str(time.time_ns())
            try:
                r = await self.http.send(request)
            except httpx.HTTPError as exc:
                failure = ModelError(None, f"model endpoint {url} unreachable: "
                                           f"{type(exc).__name__}: {exc}")
            else:
                if r.status_code < 400:
                    return self.read_reply(r)
                failure = ModelError(r.status_code, f"model endpoint answered "
                                                    f"{r.status_code}: {endpoint_message(r)}")
                if not retried(r.status_code):
                    raise failure
                retry_after = _seconds(r.headers.get("retry-after"))
            if attempt >= self.env.model_retries:
                raise ModelError(failure.status, f"{failure.message} (tried "
                                                 f"{attempt + 1} times)")
            attempt += 1
            pause = self.env.model_backoff_s * 2 ** (attempt - 1) * (0.5 + random.random() / 2)
            pause = min(BACKOFF_CAP_S, max(pause, retry_after or 0.0))
            log.warning("%s; retry %d of %d in %.2fs", failure.message, attempt,
                        self.env.model_retries, pause)
            await self.send("event", {"kind": "model", "status": "retried", "detail": {
                "status": failure.status, "message": failure.message[:300],
                "retry": attempt, "pause_s": round(pause, 3)}})
            await asyncio.sleep(pause)

    @staticmethod
    def read_reply(r: httpx.Response) -> dict[str, Any]:
        try:
            reply: dict[str, Any] = r.json()
            reply["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ModelError(r.status_code, f"model endpoint answered {r.status_code} with no "
                                            f"usable completion: {type(exc).__name__}: {exc}"
                             ) from None
        return reply


def hold_seconds(ttl_ms: Any) -> float:
    """How long a `hold` stands: its `ttl_ms`, at most a minute (a hold is for the time a
    kill's commit takes; a daemon whose control plane went quiet stops by its lease). One
    that cannot be read (not a number, not finite, -inf too, or too large for a float)
    stands the minute: a hold is the safe side. A negative number does not stand."""
    try:
        ttl = float(ttl_ms)
    except (TypeError, ValueError, OverflowError):
        return HOLD_CAP_S
    if not math.isfinite(ttl):
        return HOLD_CAP_S
    return min(max(ttl, 0.0) / 1000, HOLD_CAP_S)


def _seconds(value: str | None) -> float | None:
    """A Retry-After in seconds (the HTTP-date form is not worth a parser here)."""
    try:
        return None if value is None else max(0.0, float(value))
    except ValueError:
        return None


async def run(env: Env) -> int:
    headers = {"Authorization": f"Bearer {env.token}"}
    try:
        ws = await websockets.connect(env.ws_url, additional_headers=headers, open_timeout=10,
                                      ping_interval=5, ping_timeout=5, close_timeout=2)
    except (OSError, websockets.WebSocketException, TimeoutError) as exc:
        raise DaemonError(f"cannot reach the control plane at {env.ws_url}: {exc}") from None
    async with ws, httpx.AsyncClient() as http:
        daemon = Daemon(env, ws, http)
        await daemon.send("ready", {"agent_id": env.agent_id, "sandbox_id": env.sandbox_id,
                                    "version": __version__, "pid": os.getpid()})
        reader = asyncio.create_task(daemon.read())
        watchdog = asyncio.create_task(daemon.watch_lease())
        beat = asyncio.create_task(daemon.heartbeat())

        reader.add_done_callback(daemon.on_task_end)
        started = time.monotonic()
        stop = await daemon.stopped
        code = stop.exit_code
        # However it stops (its lease lapsed, its control plane gone, an error), nothing a
        # tool started outlives the daemon. A kill's was cut before its kill_ack.
        cut = await daemon.cut_tools()
        if stop.kind != "kill":  # an obeyed kill's last word was its kill_ack
            with contextlib.suppress(websockets.ConnectionClosed, TimeoutError, OSError):
                await asyncio.wait_for(daemon.send("stopping", {
                    **stop.payload(), "cut": cut.payload()}), LAST_WORD_S)
        if code == EXIT_KILLED:
            # No closing handshake: the channel may be the very thing that is cut.
            ws.transport.abort()
        for task in (reader, watchdog, beat, daemon.work):
            if task is not None:
                task.cancel()
        if daemon.work is not None and code != EXIT_KILLED:
            # Bounded: a run that does not end when cancelled must not keep a stopped
            # daemon alive (its exit is what the kill's grace waits for). A killed daemon
            # does not wait at all: its run is halted (it can take no step), its tools are
            # cut, and the exit below ends whatever is left of it; waiting for a cancelled
            # model request to unwind only held up the exit the operator is waiting for.
            await asyncio.wait({daemon.work}, timeout=WORK_END_S)
        log.info("exiting with %d after %.1fs: %s", code, time.monotonic() - started,
                 stop.sentence())
        if code == EXIT_KILLED:
            # Terminates immediately: the interpreter's own teardown costs about 15 ms of
            # CPU and does nothing the kernel does not do faster. A fleet kill's hundreds of
            # teardowns at once, on the control plane's host, starved the plane that was
            # still confirming the kill and requeueing its work.
            logging.shutdown()
            os._exit(code)
        return code


def in_a_crowd(kill: dict[str, Any]) -> bool:
    """Whether this kill stops many sessions at once (a fleet kill): the control plane says
    how many in `crowd`; a plane that does not say means one."""
    crowd = kill.get("crowd", 1)
    return isinstance(crowd, int) and not isinstance(crowd, bool) and crowd > 1


def step_aside() -> None:
    """Once its kill is confirmed, a daemon among many lets the sandboxes still to read
    theirs go first: a fleet kill wakes every daemon at once, and the plane's answer waits
    for the last confirmation, not for the exits. Sandboxes that share a CPU group
    (covey/cpu_group.py) weigh each other by nice value. Only in a crowd: a single kill's
    exit would wait behind the fleet's working sandboxes for nothing (its exit p99 went
    from 0.2 s to 2.2 s with 19 busy beside it)."""
    with contextlib.suppress(OSError):
        # From the priority it started at, not the one it has: a daemon the plane raised
        # (-20, ProcessProvider.hasten) and not lifted out of the group ended at -10, above
        # the sandboxes at work, which run at the priority they started at.
        os.setpriority(os.PRIO_PROCESS, 0, min(19, STARTED_NICE + STEP_ASIDE_NICE))


def main() -> None:
    # Upper case: logging knows "DEBUG", not the "debug" users write.
    level = (os.environ.get("COVEY_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(stream=sys.stderr, level=level,
                        format="%(asctime)s coveyd %(levelname)s %(message)s")
    if not become_subreaper():
        log.warning("not a subreaper: a tool's process that leaves its group and loses its "
                    "parent escapes the cut")
    try:
        env = Env.load()
        code = asyncio.run(run(env))
    except DaemonError as exc:
        log.error("%s", exc)
        code = EXIT_ERROR
    except KeyboardInterrupt:
        code = EXIT_ERROR
    sys.exit(code)


if __name__ == "__main__":
    main()
