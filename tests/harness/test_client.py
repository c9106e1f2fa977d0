"""The harness's API client waits out a control plane that sheds reads (429 + Retry-After),
as an operator would, instead of failing the game day on load shedding."""

from __future__ import annotations

import httpx

from harness.act import client as client_module
from harness.act.client import SHED_TRIES, CoveyClient


def counting(answers: list[httpx.Response]) -> tuple[httpx.MockTransport, list[int]]:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return answers[min(len(calls), len(answers)) - 1]
    return httpx.MockTransport(handler), calls


def shed() -> httpx.Response:
    return httpx.Response(429, headers={"Retry-After": "0"},
                          json={"error": "Too many reads", "hint": "retry"})


async def test_a_shed_read_is_asked_again_after_its_retry_after() -> None:
    transport, calls = counting([shed(), shed(), httpx.Response(200, json={"agents": []})])
    c = CoveyClient("http://127.0.0.1:9")
    c.http = httpx.AsyncClient(base_url="http://127.0.0.1:9", transport=transport)
    r = await c.agents()
    await c.aclose()
    assert r.status_code == 200, f"the read was not waited out: {r.status_code}"
    assert len(calls) == 3, f"{len(calls)} requests for two sheddings and an answer"


async def test_a_plane_that_sheds_for_good_gets_its_429_back_after_a_bounded_wait() -> None:
    transport, calls = counting([shed()])
    c = CoveyClient("http://127.0.0.1:9")
    c.http = httpx.AsyncClient(base_url="http://127.0.0.1:9", transport=transport)
    r = await c.agents()
    await c.aclose()
    assert r.status_code == 429 and len(calls) == SHED_TRIES, (r.status_code, len(calls))


def test_retry_after_is_kept_within_bounds() -> None:
    wait = client_module.retry_after_s
    assert wait(httpx.Response(429, headers={"Retry-After": "2"})) == 2.0
    assert wait(httpx.Response(429, headers={"Retry-After": "3600"})) == 5.0
    assert wait(httpx.Response(429, headers={"Retry-After": "soon"})) == 1.0
    assert wait(httpx.Response(429)) == 1.0
