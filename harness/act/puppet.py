"""The puppet model: an OpenAI-compatible chat-completions endpoint that answers each agent
from a behaviour, and keeps a ledger of everything the agents asked and every tool result
they reported, with wall-clock nanoseconds. The ledger is the ground truth of what each agent
did, taken outside the system under test (DESIGN §3).

An agent's behaviour is what the harness assigned to it (`Puppet.assign`, or
`POST /puppet/agents/{id}`); failing that, a `model:<behaviour>` marker in its task text;
failing that, `well_behaved`.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from harness.act import scripts

# The header coveyd stamps each model request with: when it sent it (ns, CLOCK_REALTIME).
# Spelt out, not imported: the harness knows covey only by its wire protocol.
SENT_AT_HEADER = "X-Covey-Sent-At-Ns"

# USD per million tokens in coveyd's price table for the model "puppet": (1.0, 2.0).
Reply = dict[str, Any]


def _call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def _reply(calls: list[dict[str, Any]] | None, content: str | None = None,
           prompt_tokens: float = 100, completion_tokens: float = 20) -> Reply:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:8]}", "object": "chat.completion",
        "created": int(time.time()), "model": "puppet",
        "choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop",
                     "message": {"role": "assistant", "content": content,
                                 **({"tool_calls": calls} if calls else {})}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def well_behaved(step: int, base_url: str) -> Reply:
    """A few real steps, then finish."""
    script = [_call("write_file", {"path": "notes.txt", "content": "step one\n"}),
              _call("shell", {"cmd": "cat notes.txt"}),
              _call("finish", {"result": "wrote notes.txt"})]
    return _reply([script[min(step, 2)]])


def rm_rf_loop(step: int, base_url: str) -> Reply:
    return _reply([_call("shell", {"cmd": "rm -rf ./*"})])


def identical_call_loop(step: int, base_url: str) -> Reply:
    return _reply([_call("shell", {"cmd": "ls -la"})])


def ab_cycle(step: int, base_url: str) -> Reply:
    if step % 2 == 0:
        return _reply([_call("read_file", {"path": "a.txt"})])
    return _reply([_call("write_file", {"path": "a.txt", "content": "x"})])


def runaway_spend(step: int, base_url: str) -> Reply:
    """Each answer is as long as it may be, up to 75,000 completion tokens: $0.15 a call at
    the puppet's price when the daemon allows that much."""
    return _reply([_call("shell", {"cmd": f"echo {step}"})], completion_tokens=75_000)


def failing_tool_hammer(step: int, base_url: str) -> Reply:
    return _reply([_call("http_request", {"url": f"{base_url}/puppet/fail?n={step}"})])


def silent(step: int, base_url: str) -> Reply:
    """Never finishes and never repeats itself: only a switch stops it."""
    return _reply([_call("shell", {"cmd": f"sleep 0.2; echo tick {step}"})])


def slow_writer(step: int, base_url: str) -> Reply:
    """A multi-step write: one part a step, a pause between, then finish."""
    if step < 8:
        return _reply([_call("shell", {"cmd": f"sleep 0.25; echo part {step} >> draft.txt"})])
    return _reply([_call("finish", {"result": "draft.txt written in 8 parts"})])


def print_env(step: int, base_url: str) -> Reply:
    if step == 0:
        return _reply([_call("shell", {"cmd": "env"})])
    return _reply([_call("finish", {"result": "printed"})])


def write_then_silent(step: int, base_url: str) -> Reply:
    if step == 0:
        return _reply([_call("write_file", {"path": "notes.txt", "content": "step two\n"})])
    return silent(step, base_url)


BEHAVIOURS: dict[str, Callable[[int, str], Reply]] = {
    f.__name__: f for f in (well_behaved, rm_rf_loop, identical_call_loop, ab_cycle,
                            runaway_spend, failing_tool_hammer, silent, slow_writer,
                            print_env, write_then_silent)
}
# The names the daemon's tests have always used.
BEHAVIOURS["identical_loop"] = identical_call_loop
_MARKER = re.compile(r"model:(\w+)")


@dataclass
class LedgerEntry:
    agent_id: str
    at_ns: int  # when the puppet began to handle the request (its wall clock)
    step: int
    behaviour: str
    tool_results: list[str]
    # The tool call the puppet answered with (empty for the older entries of a remote one).
    tool: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    # The usage the reply reported (what the daemon prices); NaN when the script says so.
    prompt_tokens: float = 0
    completion_tokens: float = 0
    # When the daemon sent the request, by its own stamp (covey.coveyd.SENT_AT_HEADER, the
    # same wall clock on one host); None when it sent none. `at_ns` trails it by however
    # long the puppet's event loop was busy; only this tells a request sent before the
    # daemon acknowledged its kill from one sent after.
    sent_ns: int | None = None
    # The completion the request allowed (max_tokens or max_completion_tokens); None when
    # it set none.
    max_tokens: int | None = None


# A behaviour: the name of a built-in one, of a script in fixtures/scripts, or a script.
Behaviour = str | dict[str, Any]


def behaviour_name(behaviour: Behaviour) -> str:
    if isinstance(behaviour, str):
        return behaviour
    return str(behaviour.get("name", "inline script"))


def resolve(behaviour: Behaviour) -> Behaviour:
    """A built-in behaviour's name as it is; a script's name as its script; a script checked.
    Raises ValueError with what is known."""
    if isinstance(behaviour, str):
        if behaviour in BEHAVIOURS:
            return behaviour
        if behaviour in scripts.fixture_names():
            return {"name": behaviour, **scripts.load(behaviour)}
        raise ValueError(f"unknown behaviour {behaviour!r}; known: "
                         f"{', '.join([*BEHAVIOURS, *scripts.fixture_names()])}")
    scripts.validate(behaviour)
    return behaviour


@dataclass
class Puppet:
    assigned: dict[str, Behaviour] = field(default_factory=dict)
    ledger: dict[str, list[LedgerEntry]] = field(default_factory=lambda: defaultdict(list))
    # Every call that reached the failing service, per agent (wall-clock ns).
    failures: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))

    def assign(self, agent_id: str, behaviour: Behaviour) -> None:
        self.assigned[agent_id] = resolve(behaviour)

    def behaviour_of(self, agent_id: str, messages: list[dict[str, Any]]) -> Behaviour:
        if agent_id in self.assigned:
            return self.assigned[agent_id]
        task = next((str(m.get("content") or "") for m in messages if m.get("role") == "user"),
                    "")
        match = _MARKER.search(task)
        return match.group(1) if match and match.group(1) in BEHAVIOURS else "well_behaved"

    def answer(self, agent_id: str, messages: list[dict[str, Any]], base_url: str,
               sent_ns: int | None = None, received_ns: int | None = None,
               max_tokens: int | None = None) -> Reply:
        """The behaviour's reply to this request. Like a real model, it answers no more
        completion tokens than the request allows (cut off: `finish_reason` "length"),
        unless its script says `honours_max_tokens: false`."""
        received_ns = time.time_ns() if received_ns is None else received_ns
        behaviour = self.behaviour_of(agent_id, messages)
        results = [str(m.get("content")) for m in messages if m.get("role") == "tool"]
        step = len(results)
        if isinstance(behaviour, str):
            reply = BEHAVIOURS[behaviour](step, base_url)
        else:
            call = scripts.call_at(behaviour, step, agent_id, base_url)
            reply = _reply([_call(call.tool, call.args)], prompt_tokens=call.prompt_tokens,
                           completion_tokens=call.completion_tokens)
        honours = not isinstance(behaviour, dict) or behaviour.get("honours_max_tokens", True)
        if honours and max_tokens is not None:
            _cut_off(reply, max_tokens)
        tool_calls = reply["choices"][0]["message"].get("tool_calls") or [{}]
        function = tool_calls[0].get("function", {})
        usage = reply["usage"]
        self.ledger[agent_id].append(LedgerEntry(
            agent_id, received_ns, step, behaviour_name(behaviour), results[-1:],
            function.get("name", ""), json.loads(function.get("arguments", "{}")),
            usage["prompt_tokens"], usage["completion_tokens"], sent_ns, max_tokens))
        return reply

    def actions(self, agent_id: str) -> list[LedgerEntry]:
        return list(self.ledger.get(agent_id, []))

    def failed_calls(self, agent_id: str) -> list[int]:
        return list(self.failures.get(agent_id, []))


def _cut_off(reply: Reply, max_tokens: int) -> None:
    """A reply longer than allowed, cut off at the limit as a model does. The tool call is
    kept: the puppet's calls are scripted, not generated token by token."""
    usage = reply["usage"]
    completion = usage["completion_tokens"]
    if isinstance(completion, int | float) and completion > max_tokens:
        usage["completion_tokens"] = max_tokens
        usage["total_tokens"] = usage["prompt_tokens"] + max_tokens
        reply["choices"][0]["finish_reason"] = "length"


def max_tokens_of(body: Mapping[str, Any]) -> int | None:
    """The completion a request allows: `max_completion_tokens`, else `max_tokens`."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def sent_stamp(headers: Mapping[str, str]) -> int | None:
    """The daemon's send stamp of a request; None when it is missing or not a stamp (the
    judges then fall back on the puppet's own, later, time: they fail closed)."""
    raw = headers.get(SENT_AT_HEADER)
    if raw is None or not (raw.isascii() and raw.isdigit()) or len(raw) > 19:
        return None
    return int(raw)


def _json(content: Any) -> Response:
    """JSON that may carry NaN (a script that reports a NaN usage): Starlette's JSONResponse
    refuses it, and the daemon, like Python's json, reads it."""
    return Response(json.dumps(content), media_type="application/json")


class AssignIn(BaseModel):
    behaviour: str | dict[str, Any]


def create_app(puppet: Puppet) -> FastAPI:
    app = FastAPI(title="puppet model")

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> Response:
        received_ns = time.time_ns()  # before the body is read: as early as the handler can
        try:
            body = await request.json()
            messages = body["messages"]
            if not isinstance(messages, list):
                raise TypeError("messages must be a list")
            max_tokens = max_tokens_of(body)
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": {"message": f"bad request: {exc}"}}, status_code=400)
        agent = request.headers.get("x-covey-agent", "?")
        base = str(request.base_url).rstrip("/")
        return _json(puppet.answer(agent, messages, base, sent_stamp(request.headers),
                                   received_ns, max_tokens))

    @app.post("/puppet/agents/{agent_id}", status_code=204)
    async def assign(agent_id: str, body: AssignIn) -> None:
        try:
            puppet.assign(agent_id, body.behaviour)
        except ValueError as exc:
            from fastapi import HTTPException

            raise HTTPException(422, str(exc)) from None

    @app.get("/puppet/ledger")
    async def ledger(agent: str | None = None, after_ns: int | None = None) -> Response:
        """The ledger (of one agent), in the order the puppet saw the requests; `after_ns`:
        only those it saw after then."""
        entries = puppet.actions(agent) if agent else [
            e for rows in puppet.ledger.values() for e in rows]
        if after_ns is not None:
            entries = [e for e in entries if e.at_ns > after_ns]
        return _json([asdict(e) for e in sorted(entries, key=lambda e: e.at_ns)])

    @app.get("/puppet/fail")
    async def fail(agent: str = "?") -> JSONResponse:
        puppet.failures[agent].append(time.time_ns())
        return JSONResponse({"error": "always failing"}, status_code=500)

    @app.get("/puppet/failures")
    async def failures(agent: str) -> list[int]:
        return puppet.failed_calls(agent)

    return app


class PuppetControl(Protocol):
    """How a game day steers the puppet and reads its ledger, wherever the puppet runs."""

    async def assign(self, agent_id: str, behaviour: Behaviour) -> None: ...

    async def actions(self, agent_id: str) -> list[LedgerEntry]: ...

    async def failed_calls(self, agent_id: str) -> list[int]:
        """When each call of this agent reached the failing service (wall-clock ns)."""
        ...


@dataclass
class LocalPuppet:
    """A puppet served from this process (processes and target stacks)."""

    puppet: Puppet

    async def assign(self, agent_id: str, behaviour: Behaviour) -> None:
        self.puppet.assign(agent_id, behaviour)

    async def actions(self, agent_id: str) -> list[LedgerEntry]:
        return self.puppet.actions(agent_id)

    async def failed_calls(self, agent_id: str) -> list[int]:
        return self.puppet.failed_calls(agent_id)


@dataclass
class RemotePuppet:
    """A puppet in a container of the game day, steered over its HTTP API."""

    url: str  # the puppet's base URL as this process reaches it (no /v1)

    async def assign(self, agent_id: str, behaviour: Behaviour) -> None:
        resolved = resolve(behaviour)  # the scripts are this checkout's, not the image's
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(f"{self.url}/puppet/agents/{agent_id}",
                                json={"behaviour": resolved})
            r.raise_for_status()

    async def failed_calls(self, agent_id: str) -> list[int]:
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.get(f"{self.url}/puppet/failures", params={"agent": agent_id})
            r.raise_for_status()
            return [int(n) for n in r.json()]

    async def actions(self, agent_id: str) -> list[LedgerEntry]:
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.get(f"{self.url}/puppet/ledger", params={"agent": agent_id})
            r.raise_for_status()
            return [LedgerEntry(**row) for row in r.json()]


def main() -> None:
    """`python -m harness.act.puppet --port 9000`: the puppet as a service (containers stack)."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description="the game day's puppet model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args()
    uvicorn.run(create_app(Puppet()), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
