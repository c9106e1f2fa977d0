"""An operator needs a client and a recorder, not the game day: built from those two alone it
records its kill with the tasks read right before and after it, which the requeue checkers
judge.

The control plane here is an httpx transport answering from a table.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
from faker import Faker

from harness.act.client import CoveyClient
from harness.act.operator import Operator
from harness.record.history import History
from harness.record.recorder import Recorder


def client_answering(states: list[str], each: Callable[[], object] = lambda: None
                     ) -> CoveyClient:
    """A control plane whose agent a1 has one task, in the state `states` holds at the time
    of the read (a kill moves it on); `each` is called as each request is answered."""
    def answer(request: httpx.Request) -> httpx.Response:
        each()
        if request.url.path == "/api/v1/agents/a1/kill":
            states.append("open")
            return httpx.Response(200, json={"agents_stopped": ["a1"]})
        if request.url.path == "/api/v1/agents/a1/backlog":
            return httpx.Response(200, json=[{"id": "t1", "agent_id": "a1",
                                              "state": states[-1]}])
        return httpx.Response(404, json={"error": "Not found"})
    client = CoveyClient("http://covey.test")
    client.http = httpx.AsyncClient(base_url="http://covey.test",
                                    transport=httpx.MockTransport(answer))
    return client


async def test_an_operator_of_a_client_and_a_recorder_reads_the_tasks_around_its_kill() -> None:
    client = client_answering(["in_progress"])
    history = History()
    recorder = Recorder(history=history, agents={"a1": {"id": "a1"}},
                        people={"auditor": client}, admins_beside={},
                        dialect_name="covey-gameday", stack="none", data_dir=None,
                        lease_ms=None, notes=[], measurements={})
    security = Operator("security", client, recorder, Faker())
    assert (await security.kill_agent("a1")).status_code == 200
    kill = history.operations("kill_agent")[0]
    reads = [(r.value["state"], r.end_ns is not None and r.end_ns < kill.start_ns)
             for r in history.operations("task_state")]
    assert reads == [("in_progress", True), ("open", False)], (
        f"the operator did not read the task before and after its kill: {reads}")
    await client.aclose()


async def test_a_task_read_spans_from_its_request_to_its_answer() -> None:
    """A read sent before a kill's requeue committed and answered after the kill's own
    answer shows the task in progress. Stamped on arrival, in_progress_requeued took that
    for a task still in progress after the kill; stamped when sent, a state from before a
    kill it came back after. It holds somewhere in between, and says so."""
    now = [1_000]
    history = History(clock=lambda: now[0])

    def later() -> None:  # each answer takes 5 µs of the history's clock
        now[0] += 5_000
    client = client_answering(["in_progress"], later)
    recorder = Recorder(history=history, agents={"a1": {"id": "a1"}},
                        people={"auditor": client}, admins_beside={},
                        dialect_name="covey-gameday", stack="none", data_dir=None,
                        lease_ms=None, notes=[], measurements={})
    await recorder.read_tasks()
    [read] = history.operations("task_state")
    assert (read.start_ns, read.end_ns) == (1_000, 6_000), (
        f"the read spans {read.start_ns}..{read.end_ns}, not its request (1000) to its "
        f"answer (6000)")
    assert read.value == {"task_id": "t1", "agent_id": "a1", "state": "in_progress"}
    await client.aclose()
