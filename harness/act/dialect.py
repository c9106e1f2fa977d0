"""Which API the system under test speaks, found out once, and the one place that knows what
follows from it: the client that speaks it, how a human signs in, and which rules the
harness cannot judge there for want of evidence.

Two dialects today. `covey-gameday`: this project's control plane (DESIGN §2.2), JSON
/healthz, API tokens, sessions and sandboxes in the API, agents driven by the puppet model.
`upstream`: covey as published (github.com/benjaminLedel/covey), whose /healthz answers a
plain `ok`, whose people sign in with a cookie session, and whose agents run its `mock`
engine from directives in the task body (harness/act/upstream.py).

    spoken = await detect(url, "auto")   # Spoken(dialect="upstream", ...)
    client = await sign_in(spoken.dialect, url, email, password)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from harness.act.client import CoveyClient
from harness.act.switch_line import SwitchLine
from harness.act.upstream import UPSTREAM_LACKS, MockDirectives, UpstreamClient

AUTO = "auto"
COVEY_GAMEDAY = "covey-gameday"
UPSTREAM = "upstream"
DIALECTS = (COVEY_GAMEDAY, UPSTREAM)


# How this project refuses a wake path while a stop stands (DESIGN §2.3 line 3).
STOPPED = {"error": "Agent or fleet is stopped", "hint": "resume it first."}


@dataclass(frozen=True)
class Dialect:
    name: str
    client: type[CoveyClient]
    # The checkers whose evidence this dialect's server does not expose, each with what is
    # missing: they say `unknown` with that sentence, and no game day requires them there.
    lacks: Mapping[str, str] = field(default_factory=dict)
    # Whether a switch's answer reports what it did (agents stopped, tasks requeued, sessions
    # cancelled, agents woken); where it does not, the harness reads that back instead.
    reports: bool = True
    # What each wake path answers while a stop stands: status and body. DESIGN §2.3 line 3
    # asks 409 of the heartbeat fire and the trigger; of the manual wake only that it starts
    # nothing (judged from the sandboxes, not from its status).
    refusals: Mapping[str, tuple[int, dict[str, Any]]] = field(default_factory=lambda: {
        "fire_heartbeat": (409, STOPPED), "trigger": (409, STOPPED), "wake": (409, STOPPED)})
    notifications: bool = True  # org admins and controlling are notified of a fleet stop
    # Whether the harness reads the agents' recording there (task results by session).
    recording: bool = True
    # Why a game day's rollback deletes its agents there (None: it stops them and keeps
    # them, as this project's API has it).
    retires_agents: str | None = None


REGISTRY: dict[str, Dialect] = {
    COVEY_GAMEDAY: Dialect(COVEY_GAMEDAY, CoveyClient),
    UPSTREAM: Dialect(UPSTREAM, UpstreamClient, UPSTREAM_LACKS, reports=False, refusals={
        "fire_heartbeat": (409, {"error": "Agent or fleet is stopped — resume it first."}),
        "trigger": (409, {"error": "agent is stopped"}),
        "wake": (200, {"ok": True})}, notifications=False, recording=False,
        retires_agents="upstream's fleet resume would revive it though its own switch "
                       "stopped it"),
}


def dialect(name: str) -> Dialect:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"no dialect {name!r}; dialects: {', '.join(DIALECTS)}") from None


class DialectNotRecognised(Exception):
    """The server's first answer fits no dialect the harness speaks (or not the one asked
    for): names the request, what it answered and what was expected."""


@dataclass(frozen=True)
class Spoken:
    """What the server was found to speak, and what its /healthz said."""

    dialect: str
    health: dict[str, Any]
    how: str  # "asked" or what gave it away, for the journal


def recognise(response: httpx.Response) -> tuple[str, dict[str, Any]]:
    """The dialect a /healthz answer belongs to: a JSON object (this project's, with its
    version and lease) or upstream's plain `ok`. DialectNotRecognised otherwise."""
    asked = f"{response.request.method} {response.request.url}"
    if response.status_code != 200:
        raise DialectNotRecognised(
            f"{asked} answered {response.status_code} {response.text[:200]!r}, expected 200 "
            f"with a JSON object (covey-gameday) or a plain `ok` (upstream covey)")
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return COVEY_GAMEDAY, body
    if response.text.strip() == "ok":
        return UPSTREAM, {}
    raise DialectNotRecognised(
        f"{asked} answered 200 {response.text[:200]!r}, expected a JSON object "
        f"(covey-gameday) or a plain `ok` (upstream covey): is this a covey control plane?")


async def detect(url: str, asked: str = AUTO, timeout_s: float = 10,
                 transport: httpx.AsyncBaseTransport | None = None) -> Spoken:
    """The dialect of the server at `url`: read from its /healthz, and checked against the
    one `asked` for unless that is `auto`."""
    if asked != AUTO:
        dialect(asked)  # a misspelt dialect fails before any request
    async with httpx.AsyncClient(timeout=timeout_s, transport=transport) as http:
        try:
            response = await http.get(f"{url.rstrip('/')}/healthz")
        except httpx.HTTPError as exc:
            raise DialectNotRecognised(
                f"GET {url.rstrip('/')}/healthz failed ({exc!r}), expected an answer from a "
                f"covey control plane: is it running there?") from exc
    found, health = recognise(response)
    if asked not in (AUTO, found):
        raise DialectNotRecognised(
            f"--dialect {asked} was asked for, but GET {url.rstrip('/')}/healthz answered "
            f"{response.text[:120]!r}, which is how {found} answers; give --dialect {found} "
            f"or --dialect auto")
    return Spoken(found, health, "asked" if asked != AUTO else "found from /healthz")


async def sign_in(name: str, url: str, email: str, password: str,
                  directives: MockDirectives | None = None, line: SwitchLine | None = None
                  ) -> CoveyClient:
    """A human of the deployment, signed in as its dialect signs people in; its stops sent
    down `line` when there is one."""
    if name == UPSTREAM:
        return await UpstreamClient.signed_in_upstream(url, email, password, directives,
                                                       line=line)
    return await dialect(name).client.signed_in(url, email, password, line=line)


async def server_version(client: CoveyClient, health: dict[str, Any]) -> dict[str, str]:
    """The server's version as it states it: this project's in /healthz, upstream's at
    /api/v1/version (signed in: upstream keeps it from strangers)."""
    if not isinstance(client, UpstreamClient):
        return {"covey": str(health.get("version", "?"))}
    r = await client.get("/api/v1/version")
    if r.status_code != 200:
        return {"covey": f"unknown (GET /api/v1/version answered {r.status_code})"}
    body = r.json()
    return {"covey": str(body.get("version", "?")), "covey_commit": str(body.get("commit", "?"))}
