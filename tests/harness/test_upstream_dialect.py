"""The upstream dialect against answers recorded from a real upstream covey (458b742, built
by ../shared/upstream-covey/bringup.sh): CI cannot build upstream, so its answers are
replayed here as `python -m harness.stack.record_upstream` recorded them (the file says
when, and from which commits)."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from harness.act.client import ApiFailure, CoveyClient, json_of
from harness.act.dialect import (
    COVEY_GAMEDAY,
    UPSTREAM,
    DialectNotRecognised,
    detect,
    dialect,
    recognise,
)
from harness.act.upstream import WORK_S, MockDirectives, UpstreamClient
from harness.judge.bounds import KNOWN_BOUNDS
from harness.judge.checkers import Verdict
from harness.judge.verdicts import KNOWN_CHECKERS, NOT_JUDGEABLE, broken_rules
from harness.record.gameday import GameDay
from harness.record.sandbox_events import SandboxWatch, lives_from_events, sandbox_lives, watching
from harness.report.answer import answer
from harness.report.specimen import specimen_game_day
from harness.run.steady import SteadyStateNotMet, prepare
from harness.stack.base import Endpoints, free_port
from harness.stack.record_upstream import template
from harness.stack.waiting import eventually

RECORDING = json.loads((Path(__file__).parent / "recorded" / "upstream_answers.json")
                       .read_text())
URL = "http://upstream.test"
AGENT = RECORDING["agent_id"]


class Replay(httpx.AsyncBaseTransport):
    """Upstream's recorded answers, each path's in the order recorded (the last one
    repeats); a path upstream was never asked answers as upstream answers an unknown path.
    `override`: (method, path template) -> (status, body) instead of the recording."""

    def __init__(self, override: dict[tuple[str, str], tuple[int, Any]] | None = None) -> None:
        self.answers: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for e in RECORDING["exchanges"]:
            self.answers[(e["method"], e["path"])].append(e)
        self.override = override or {}
        self.sent: list[tuple[str, str, Any, str | None]] = []

    def skip(self, method: str, path: str, n: int = 1) -> None:
        del self.answers[(method, path)][:n]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = (request.method, template(request.url.path))
        body = json.loads(request.content) if request.content else None
        self.sent.append((*key, body, request.headers.get("cookie")))
        if key in self.override:
            status, answer = self.override[key]
            return httpx.Response(status, content=json.dumps(answer).encode(),
                                  headers={"content-type": "application/json"})
        queue = self.answers.get(key)
        if not queue:
            unknown = self.answers[("POST", "/api/v1/members")][0]
            return httpx.Response(404, text=unknown["body"],
                                  headers={"content-type": unknown["content_type"]})
        e = queue.pop(0) if len(queue) > 1 else queue[0]
        headers = {"content-type": e["content_type"]}
        if e["set_cookie"]:
            headers["set-cookie"] = "covey_session=recorded; Path=/; HttpOnly; SameSite=Strict"
        return httpx.Response(e["status"], text=e["body"], headers=headers)


async def signed_in(replay: Replay, directives: MockDirectives | None = None
                    ) -> UpstreamClient:
    return await UpstreamClient.signed_in_upstream(URL, "admin@covey.local", "pw",
                                                   directives, transport=replay)


def test_the_recording_says_when_and_from_which_commits() -> None:
    assert RECORDING["recorded_at"] and RECORDING["server"]["commit"].startswith("458b742")
    assert RECORDING["recorded_by"]["commit"] not in ("", "unknown")


async def test_plain_ok_healthz_is_upstream_and_json_is_this_projects() -> None:
    assert (await detect(URL, transport=Replay())).dialect == UPSTREAM
    own = httpx.MockTransport(lambda r: httpx.Response(200, json={"status": "ok",
                                                                  "version": "0.9"}))
    spoken = await detect(URL, transport=own)
    assert (spoken.dialect, spoken.health["version"]) == (COVEY_GAMEDAY, "0.9")


async def test_a_dialect_asked_for_that_the_server_does_not_speak_says_what_it_answered(
        ) -> None:
    with pytest.raises(DialectNotRecognised, match=r"--dialect covey-gameday was asked for, "
                       r"but GET http://upstream.test/healthz answered 'ok'.*upstream"):
        await detect(URL, "covey-gameday", transport=Replay())


def test_a_healthz_of_neither_dialect_names_the_request_and_what_was_expected() -> None:
    page = httpx.Response(200, text="<html>welcome</html>",
                          request=httpx.Request("GET", f"{URL}/healthz"))
    with pytest.raises(DialectNotRecognised, match=r"GET http://upstream.test/healthz answered "
                       r"200 '<html>welcome</html>', expected a JSON object"):
        recognise(page)


async def test_sign_in_is_a_cookie_session_and_me_speaks_snake_case() -> None:
    replay = Replay()
    admin = await signed_in(replay)
    me = json_of(await admin.me())
    assert me["org_id"] == json.loads(RECORDING["exchanges"][3]["body"])["OrgID"]
    assert me["role"] == "org_admin"
    assert replay.sent[-1][3] == "covey_session=recorded", "the session cookie was not sent"


async def test_this_projects_dialect_on_upstream_fails_naming_the_request_it_sent() -> None:
    with pytest.raises(ApiFailure, match=r"POST /api/v1/auth/tokens answered 404, expected "
                       r"201: <!doctype html>"):
        await CoveyClient.signed_in(URL, "admin@covey.local", "pw", transport=Replay())


async def test_members_are_upstreams_users_with_a_display_name() -> None:
    replay = Replay()
    admin = await signed_in(replay)
    json_of(await admin.add_member("sec@x.test", "password-1234", "security"), 201)
    method, path, body, _ = replay.sent[-1]
    assert (method, path, body["role"], body["display_name"]) == (
        "POST", "/api/v1/users", "security", "sec")


async def test_an_agent_is_created_hired_and_its_trigger_enabled() -> None:
    replay = Replay()
    admin = await signed_in(replay)
    agent = json_of(await admin.create_agent("gd-x", "x", warm_sandbox=False, max_turns=5),
                    201)
    assert [s[:2] for s in replay.sent[-4:]] == [
        ("POST", "/api/v1/agents"), ("POST", "/api/v1/agents/{id}/hire"),
        ("POST", "/api/v1/agents/{id}/webhook"), ("GET", "/api/v1/agents/{id}")]
    assert replay.sent[-4][2]["runtime"] == "mock"
    assert agent["id"] == AGENT and len(agent["trigger_token"]) == 64
    assert agent["dialect_dropped"] == ["max_turns"]


async def test_a_hire_upstream_refuses_is_the_failure_the_game_day_shows() -> None:
    replay = Replay({("POST", "/api/v1/agents/{id}/hire"): (403, {"error": "forbidden"})})
    admin = await signed_in(replay)
    with pytest.raises(ApiFailure, match=rf"POST /api/v1/agents/{AGENT}/hire answered 403, "
                       r"expected 201: .*forbidden"):
        json_of(await admin.create_agent("gd-x", "x"), 201)


async def test_tasks_carry_the_mock_engines_directives_for_the_agents_behaviour() -> None:
    directives = MockDirectives()
    await directives.assign("a", "silent")
    await directives.assign("b", "well_behaved")
    assert directives.body("a") == f"[mock:sleep {WORK_S}s]\n[mock:result worked {WORK_S}s]"
    assert directives.body("b") == "[mock:result done]"
    assert directives.body("a", "[mock:fail no]") == "[mock:fail no]"
    replay = Replay()
    admin = await signed_in(replay, directives)
    json_of(await admin.create_task(AGENT, "work"), 201)
    assert replay.sent[-1][2] == {"title": "work", "body": "[mock:result done]"}


async def test_a_heartbeat_is_a_line_of_heartbeat_md_that_upstream_reads() -> None:
    replay = Replay()
    admin = await signed_in(replay)
    json_of(await admin.add_heartbeat(AGENT, "hourly", "", 3600), 201)
    method, path, body, _ = replay.sent[-1]
    assert (method, path) == ("PUT", "/api/v1/agents/{id}/config")
    line = body["files"]["HEARTBEAT.md"]
    assert line == "- alle: 3600s titel: hourly aufgabe: [mock:result done]\n"
    # The same line as recorded: upstream read it as an hourly heartbeat.
    recorded = next(e for e in RECORDING["exchanges"] if e["path"].endswith("/heartbeats"))
    assert [(h["name"], h["every_seconds"]) for h in json.loads(recorded["body"])] == [
        ("hourly", 3600)]


async def test_the_switches_and_the_wake_paths_during_a_stop_as_upstream_answers() -> None:
    replay = Replay()
    admin = await signed_in(replay)
    assert json_of(await admin.kill_agent(AGENT)) == {"ok": True}
    assert json_of(await admin.kill_fleet()) == {"ok": True}
    replay.skip("GET", "/api/v1/fleet")
    assert json_of(await admin.fleet()) == {"fleet_killed": True}
    fire = await admin.fire_heartbeat(AGENT, "hourly")
    assert (fire.status_code, fire.json()["error"]) == (
        409, "Agent or fleet is stopped — resume it first.")
    trigger = await admin.trigger("f" * 64)
    assert (trigger.status_code, trigger.json()) == (409, {"error": "agent is stopped"})
    assert (await admin.wake(AGENT)).status_code == 200  # accepted; nothing starts
    assert json_of(await admin.resume_fleet()) == {"ok": True}


async def test_a_killed_agents_sandbox_and_its_exit_come_from_dockers_events() -> None:
    rows = lives_from_events(RECORDING["docker_events"])
    killed = rows[0]
    assert (killed["state"], killed["exit_code"]) == ("gone", 3)
    assert killed["daemon_exited_at"] == killed["gone_at"] is not None
    admin = await signed_in(Replay())
    admin.read_sandboxes = lambda agent, since: rows
    sessions = json_of(await admin.sessions(AGENT))
    assert sessions[0]["sandbox_id"] == killed["id"]
    assert (sessions[0]["state"], sessions[0]["stop_reason"]) == ("ended", "sandbox exited 3")


async def test_a_task_is_read_from_the_backlog_with_its_transitions() -> None:
    replay = Replay()
    admin = await signed_in(replay)
    backlog = json_of(await admin.backlog(AGENT))
    task = json_of(await admin.task(AGENT, backlog[0]["id"]))
    assert task["transitions"][0]["to_state"] == "in_progress"


async def test_what_upstream_lacks_answers_501_and_is_never_sent() -> None:
    replay = Replay()
    admin = await signed_in(replay)
    sent = len(replay.sent)
    r = await admin.stop_globally("drill")
    assert r.status_code == 501 and "upstream covey has no global kill flag" in r.text
    with pytest.raises(ApiFailure, match="POST /api/v1/platform/orgs answered 501"):
        json_of(await admin.create_org("o", "a@x.test", "pw"), 201)
    assert len(replay.sent) == sent


def game_day_on(dialect_name: str, required: frozenset[str], tmp_path: Path) -> GameDay:
    endpoints = Endpoints(URL, "a@x.test", "pw", MockDirectives(), "none", {},
                          dialect=dialect_name)
    return GameDay(name="g", stack="target", endpoints=endpoints, seed=1,
                   report_dir=tmp_path, required=required)


def test_checkers_upstream_lacks_evidence_for_say_unknown_and_are_not_required(
        tmp_path: Path) -> None:
    lacks = dialect(UPSTREAM).lacks
    assert set(lacks) <= KNOWN_CHECKERS | KNOWN_BOUNDS, "a lacking checker's name is no checker"
    day = game_day_on(UPSTREAM, frozenset({"kill_obeyed", "no_wake_of_stopped_agent"}),
                      tmp_path)
    assert day.required == {"no_wake_of_stopped_agent"}
    verdicts = day.unjudgeable([Verdict("kill_obeyed", True, "vacuous"),
                                Verdict("no_wake_of_stopped_agent", True, "held")])
    assert verdicts[0].valid == "unknown" and "no kill delivery" in verdicts[0].message
    assert verdicts[1].valid is True
    assert broken_rules(verdicts, day.required) == []
    bounded = GameDay(name="g", stack="target", endpoints=day.endpoints, seed=1,
                      report_dir=tmp_path, bounds={"actions_after_request": 3})
    assert bounded.required == frozenset(), "a figure read from the ledger is required"
    own = game_day_on(COVEY_GAMEDAY, frozenset({"kill_obeyed"}), tmp_path)
    assert own.required == {"kill_obeyed"}
    assert own.unjudgeable([Verdict("kill_obeyed", True, "held")])[0].valid is True


@pytest.fixture
async def upstream_served() -> AsyncIterator[str]:
    """The recorded answers served over loopback HTTP, as a deployment would answer."""
    replay = Replay()

    async def answer(request: Request) -> Response:
        sent = httpx.Request(request.method, str(request.url), headers=request.headers.raw,
                             content=await request.body())
        got = await replay.handle_async_request(sent)
        await got.aread()
        return Response(got.content, got.status_code, headers={
            k: v for k, v in got.headers.items() if k in ("content-type", "set-cookie")})
    app = Starlette(routes=[Route("/{path:path}", answer,
                                  methods=["GET", "POST", "PUT", "PATCH", "DELETE"])])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    serving = asyncio.create_task(server.serve())
    await eventually(lambda: _started(server), 10, "the recorded upstream did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving


async def _started(server: uvicorn.Server) -> bool:
    return bool(server.started)


async def test_a_game_day_that_cannot_start_names_the_request_and_what_it_expected(
        upstream_served: str, tmp_path: Path) -> None:
    """This project's dialect against upstream: refused before anything is made, saying
    which request failed and what was expected (it once said only `aborted`)."""
    endpoints = Endpoints(upstream_served, "admin@covey.local", "pw", MockDirectives(),
                          "none", {}, dialect=COVEY_GAMEDAY)
    day = GameDay(name="g", stack="target", endpoints=endpoints, seed=1, report_dir=tmp_path)
    with pytest.raises(SteadyStateNotMet, match=r"finding the game day's organisation .* "
                       r"failed: POST /api/v1/auth/tokens answered 404, expected 201"):
        await prepare(day)
    assert day.journal_path is not None
    journal = json.loads(day.journal_path.read_text())
    assert journal["status"] == "not_started" and journal["dialect"] == COVEY_GAMEDAY
    assert "--dialect" in journal["steady_state_hypothesis"][-1]["fix"]


def test_sandboxes_are_read_from_the_watch_that_followed_them() -> None:
    """Read afterwards, the engine keeps only its last 256 events: while a stack follows
    them, each agent's sandboxes come from that watch."""
    watch = SandboxWatch()
    watch.events.extend(RECORDING["docker_events"])
    with watching(watch):
        rows = sandbox_lives(AGENT, since_s=0)
    assert (rows[0]["state"], rows[0]["exit_code"]) == ("gone", 3)
    assert watch.lives("another-agent") == []


async def test_an_empty_list_upstream_answers_null_reads_as_an_empty_one() -> None:
    replay = Replay({("GET", "/api/v1/tasks/{id}/transitions"): (200, None),
                     ("GET", "/api/v1/agents/{id}/backlog"): (200, None)})
    admin = await signed_in(replay)
    assert json_of(await admin.backlog(AGENT)) == []


def test_the_headline_counts_no_actions_where_the_dialect_has_no_ledger() -> None:
    journal, _ = specimen_game_day(2)
    for v in journal["verdicts"]:
        if v["checker"] == "no_action_after_kill_ack":
            v.update(valid="unknown", message=f"{NOT_JUDGEABLE} upstream covey: no ledger.")
    line = " · ".join(answer(journal).headline)
    assert "actions after the request not seen" in line and "0 actions" not in line
