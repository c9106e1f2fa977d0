"""A scripted sandbox daemon for covey's tests and benchmarks: speaks the real protocol over a
real WebSocket, started by the real `process` sandbox backend, and writes down every message
it sends and receives in $HOME/transcript.jsonl. What it does with a task is in the task body:

  hold        keep the task until killed
  deaf        keep the task and ignore `kill`: stop only when the kill-flag lease runs out
              (no renewal within its ttl), saying so in a `stopping` message, and exit 3
              with the same log lines as an obeyed kill (a daemon whose kill handling broke)
  work:SECS   work SECS seconds, then report it done
  crash       die at once with exit code 1, as a crashing daemon would
  crash-later die after 2 seconds with exit code 1
  anything    report it done at once

On `kill` it first sends a result for the task it holds (a killed session must be refused),
waits for the answer, then acknowledges the kill (`kill_ack`), logs the kill lines and exits
3, as coveyd does. `sleep` exits 0. With SCRIPTED_DAEMON_PLAIN_KILL=1 it sends no late result
and acknowledges and exits 3 at once, as covey/coveyd.py does; benchmarks/kill_latency.py
uses that, so that no result races the kill it measures.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import websockets

TRANSCRIPT = Path(os.environ.get("HOME", ".")) / "transcript.jsonl"
SANDBOX = os.environ.get("COVEY_SANDBOX_ID", "")
PLAIN_KILL = os.environ.get("SCRIPTED_DAEMON_PLAIN_KILL") == "1"


def note(direction: str, message: dict[str, Any]) -> None:
    with TRANSCRIPT.open("a") as out:
        out.write(json.dumps({"at_ns": time.time_ns(), "sandbox": SANDBOX, "dir": direction,
                              **message}) + "\n")


async def main() -> int:
    url = os.environ["COVEY_WS_URL"]
    headers = {"Authorization": f"Bearer {os.environ['COVEY_DAEMON_TOKEN']}"}
    async with websockets.connect(url, additional_headers=headers) as ws:

        async def send(kind: str, payload: dict[str, Any]) -> None:
            message = {"type": kind, "payload": payload}
            note("out", message)
            await ws.send(json.dumps(message))

        await send("ready", {"agent_id": os.environ["COVEY_AGENT_ID"], "sandbox_id": SANDBOX})
        held: dict[str, Any] | None = None
        work: asyncio.Task[None] | None = None
        deaf = False
        lease_until: float | None = None  # monotonic; renewed by every `lease`

        async def do_work(task: dict[str, Any], seconds: float) -> None:
            await asyncio.sleep(seconds)
            await send("task_done", {"task_id": task["task_id"],
                                     "fencing_token": task["fencing_token"], "result": "ok"})

        while True:
            try:
                if deaf and lease_until is not None:
                    raw = await asyncio.wait_for(ws.recv(),
                                                 max(0.0, lease_until - time.monotonic()))
                else:
                    raw = await ws.recv()
            except TimeoutError:
                await send("stopping", {"stop": "lease", "exit_code": 3,
                                        "detail": "kill-flag lease expired; failing closed"})
                print("kill switch: lease expired; daemon terminates immediately", flush=True)
                return 3
            except websockets.ConnectionClosed:
                return 1
            message = json.loads(raw)
            note("in", message)
            kind, payload = message["type"], message.get("payload", {})
            if kind == "lease":
                lease_until = time.monotonic() + float(payload.get("ttl_ms", 0)) / 1000
            elif kind == "assign_task":
                held = payload
                body = payload.get("body", "")
                if body in ("hold", "deaf"):
                    deaf = body == "deaf"
                    continue
                if body.startswith("crash"):
                    await asyncio.sleep(2 if body == "crash-later" else 0)
                    print("scripted crash", flush=True)
                    return 1
                seconds = float(body.split(":", 1)[1]) if body.startswith("work:") else 0.0
                work = asyncio.create_task(do_work(payload, seconds))
            elif kind == "kill" and deaf:
                continue  # the broken daemon: it heard the kill and works on
            elif kind == "kill":
                if work is not None:
                    work.cancel()
                if held is not None and not PLAIN_KILL:
                    await send("task_done", {"task_id": held["task_id"],
                                             "fencing_token": held["fencing_token"],
                                             "result": "after the kill"})
                    async with asyncio.timeout(5):
                        while True:  # leases may arrive before the answer
                            answer = json.loads(await ws.recv())
                            note("in", answer)
                            if answer["type"] == "error":
                                break
                await send("kill_ack", {"stop": "kill", "exit_code": 3,
                                        "detail": "reason kill-switch"})
                print("kill switch: daemon terminates immediately", flush=True)
                os._exit(3)  # as coveyd does: no interpreter teardown
            elif kind == "sleep":
                return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
