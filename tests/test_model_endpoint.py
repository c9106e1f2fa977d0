"""coveyd against model endpoints that misbehave, end to end in processes: one that refuses
a call (a 4xx), one that is rate limited or down for a moment (429, 5xx), one that answers
more than it was allowed, and models nobody can price. Each fake endpoint is a real HTTP
server on a loopback port."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.parser import text_string_to_metric_families

from covey.testing.plane import World, make_world, start_plane
from harness.act.puppet import Puppet, max_tokens_of
from harness.stack.base import free_port
from harness.stack.waiting import eventually
from tests.conftest import COVEYD


@dataclass
class TroubledModel:
    """The puppet behind a queue of error answers per agent: each request of an agent with
    errors left gets the next one instead of a completion."""

    puppet: Puppet = field(default_factory=Puppet)
    errors: dict[str, list[tuple[int, dict[str, Any]]]] = field(
        default_factory=lambda: defaultdict(list))
    requests: Counter[str] = field(default_factory=Counter)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            agent = request.headers.get("x-covey-agent", "?")
            self.requests[agent] += 1
            if self.errors[agent]:
                status, answer = self.errors[agent].pop(0)
                return JSONResponse(answer, status_code=status)
            reply = self.puppet.answer(agent, body["messages"], "http://x",
                                       max_tokens=max_tokens_of(body))
            # json.dumps, not JSONResponse: a scripted usage may be NaN.
            return Response(json.dumps(reply), media_type="application/json")
        return app


@pytest.fixture
async def troubled(database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                   ) -> AsyncIterator[tuple[World, TroubledModel]]:
    monkeypatch.setenv("COVEY_MODEL_BACKOFF_MS", "20")  # passed on to the sandboxes
    model = TroubledModel()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(model.app(), host="127.0.0.1", port=port,
                                           log_level="warning"))
    serving = asyncio.create_task(server.serve())

    async def started() -> bool:
        return server.started
    await eventually(started, 10, "the model endpoint did not start")
    try:
        async with start_plane(database_url, tmp_path, COVEYD,
                               model_url=f"http://127.0.0.1:{port}/v1") as plane, \
                make_world(plane) as world:
            yield world, model
    finally:
        server.should_exit = True
        await serving


async def _ended_session(world: World, agent_id: str) -> dict[str, Any]:
    async def recorded() -> dict[str, Any] | None:
        rows = (await world.auditor.get(f"/api/v1/agents/{agent_id}/sessions")).json()
        done = [s for s in rows if s["daemon_stop"]]
        return done[0] if done else None
    return await eventually(recorded, 20, "the session never recorded why its daemon stopped")


async def test_a_400_blocks_the_task_with_the_endpoints_words_and_no_retry(
        troubled: tuple[World, TroubledModel]) -> None:
    world, model = troubled
    agent = await world.agent()
    words = "Invalid model name passed in model=gpt-4o-mnii"
    model.errors[agent["id"]] = [(400, {"error": {"message": words, "code": "400"}})] * 20
    task = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(task["id"], "blocked")
    got = (await world.org_admin.get(f"/api/v1/agents/{agent['id']}/tasks/{task['id']}")
           ).json()
    assert got["result"] == f"model endpoint answered 400: {words}"
    session = await _ended_session(world, agent["id"])
    assert session["daemon_stop"] == "error"
    assert session["daemon_stop_detail"] == f"model endpoint answered 400: {words}"
    # No retry storm: one request, no daemon loss counted, no other session started.
    await asyncio.sleep(1.0)
    assert model.requests[agent["id"]] == 1
    assert await world.db.fetchval("SELECT daemon_retries FROM backlog_tasks WHERE id=$1",
                                   uuid.UUID(task["id"])) == 0
    assert await world.db.fetchval("SELECT count(*) FROM sessions WHERE agent_id=$1",
                                   uuid.UUID(agent["id"])) == 1
    assert await world.task_state(task["id"]) == "blocked"


async def test_a_429_and_a_503_are_retried_and_counted(
        troubled: tuple[World, TroubledModel]) -> None:
    world, model = troubled
    agent = await world.agent()
    model.errors[agent["id"]] = [
        (429, {"error": {"message": "Rate limit reached for requests"}}),
        (503, {"error": {"message": "upstream unavailable"}})]
    task = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(task["id"], "done")
    assert model.requests[agent["id"]] == 2 + 3  # two refused, then the three steps
    rec = (await world.auditor.get(f"/api/v1/agents/{agent['id']}/recording")).json()
    retries = [e["detail"] for e in rec if e["kind"] == "model" and e["status"] == "retried"]
    assert [(r["status"], r["retry"]) for r in retries] == [(429, 1), (503, 2)], retries
    assert "Rate limit reached" in retries[0]["message"]


async def test_an_endpoint_down_for_good_blocks_the_task_once_the_retries_are_spent(
        troubled: tuple[World, TroubledModel]) -> None:
    world, model = troubled
    agent = await world.agent()
    model.errors[agent["id"]] = [(502, {"error": {"message": "bad gateway"}})] * 20
    task = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(task["id"], "blocked")
    session = await _ended_session(world, agent["id"])
    assert session["daemon_stop_detail"] == "model endpoint answered 502: bad gateway " \
        "(tried 5 times)"
    assert model.requests[agent["id"]] == 5  # COVEY_MODEL_RETRIES: 4 by default


async def test_an_endpoint_that_answers_more_than_allowed_trips_at_once(
        troubled: tuple[World, TroubledModel]) -> None:
    world, model = troubled
    agent = await world.agent(guard={"max_completion_tokens": 500})
    model.puppet.assign(agent["id"], "overrun_max_tokens")
    await world.task(agent["id"], "spend")
    session = await _ended_session(world, agent["id"])
    assert session["daemon_stop"] == "guard"
    assert session["stop_layer"] == "budget"
    assert session["stop_reason"].startswith(
        "the model endpoint answered 75000 completion tokens, more than the 500 it was "
        "allowed"), session["stop_reason"]
    assert model.requests[agent["id"]] == 1
    # The overrun was paid all the same: it is on the books.
    spent = await world.db.fetchval("SELECT sum(usd)::float8 FROM cost_entries"
                                    " WHERE agent_id=$1", uuid.UUID(agent["id"]))
    assert spent == pytest.approx((100 * 1.0 + 75_000 * 2.0) / 1e6)


@pytest.mark.parametrize(("fields", "behaviour", "calls", "reason"), [
    ({"model": "nobody-priced-this"}, "silent", 0,
     "model 'nobody-priced-this' has no known price; refusing to spend blind"),
    ({}, "nan_usage", 1, "model reported unusable token counts nan/20"),
])
async def test_a_model_nobody_can_price_stops_the_agent_at_its_first_call(
        troubled: tuple[World, TroubledModel], fields: dict[str, Any], behaviour: str,
        calls: int, reason: str) -> None:
    world, model = troubled
    agent = await world.agent(**fields)
    model.puppet.assign(agent["id"], behaviour)
    await world.task(agent["id"], "work")
    session = await _ended_session(world, agent["id"])
    assert (session["stop_layer"], session["stop_reason"]) == ("budget", reason)
    assert model.requests[agent["id"]] == calls


async def test_spend_read_back_through_the_api_equals_the_booked_cost_entries(
        troubled: tuple[World, TroubledModel]) -> None:
    world, model = troubled
    before = (await world.anonymous.get("/metrics")).text
    agent = await world.agent(budget_usd=0.5, guard={"max_completion_tokens": 100_000,
                                                     "max_tokens": 10_000_000})
    model.puppet.assign(agent["id"], "runaway_spend")
    await world.task(agent["id"], "spend")
    session = await _ended_session(world, agent["id"])
    assert session["stop_layer"] == "budget"
    books = await world.db.fetchrow(
        "SELECT sum(usd)::float8 AS usd, sum(tokens)::int AS tokens, count(*) AS calls"
        " FROM cost_entries WHERE agent_id=$1", uuid.UUID(agent["id"]))
    assert books["calls"] >= 4 and books["usd"] > 0.45

    got = (await world.auditor.get(f"/api/v1/agents/{agent['id']}")).json()
    assert got["spent_usd"] == pytest.approx(books["usd"], abs=1e-9)
    assert got["spent_tokens"] == books["tokens"]
    assert got["remaining_usd"] == 0.5  # no session runs: the next one gets its whole budget
    listed = (await world.auditor.get("/api/v1/agents")).json()
    assert [a["spent_usd"] for a in listed if a["id"] == agent["id"]] == [got["spent_usd"]]
    [read] = (await world.auditor.get(f"/api/v1/agents/{agent['id']}/sessions")).json()
    assert read["spent_usd"] == pytest.approx(books["usd"], abs=1e-9)
    assert read["spent_tokens"] == books["tokens"] and read["budget_usd"] == 0.5
    assert read["remaining_usd"] == pytest.approx(0.5 - books["usd"], abs=1e-9)
    assert 0 <= read["remaining_usd"] < 0.01  # stopped at its ceiling, not past it

    # On the page too, for whoever is on call.
    async with httpx.AsyncClient(base_url=world.plane.url, timeout=30) as browser:
        r = await browser.post("/api/v1/auth/login", json={
            "email": "auditor@acme.test", "password": "correct horse battery"})
        assert r.status_code == 200, r.text
        page = (await browser.get("/administration")).text
    row = page[page.index(f'data-agent-id="{agent["id"]}"'):].split("</tr>")[0]
    assert f'class="spent num">${got["spent_usd"]:.4f}</td>' in row, row
    assert 'class="budget num">$0.5000</td>' in row, row

    after = (await world.anonymous.get("/metrics")).text
    spend = _sample(after, "covey_model_spend_usd_total", agent_id=agent["id"])
    assert spend == pytest.approx(books["usd"], abs=1e-5)  # the books keep micro-dollars
    assert _sample(after, "covey_model_tokens_total", agent_id=agent["id"]) == books["tokens"]
    trips = _sample(after, "covey_guard_trips_total", layer="budget") - _sample(
        before, "covey_guard_trips_total", layer="budget")
    assert trips == 1


def _sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0
