"""The benchmarks' sandbox daemon: speaks the real protocol over a real WebSocket, started
by the real `process` sandbox backend, holds the task it is given until it is killed, and on
`kill` confirms it (`kill_ack`), hangs up and exits 3 at once, without the interpreter's
teardown, as covey/coveyd.py does (and covey/testing/scripted_daemon.py with
SCRIPTED_DAEMON_PLAIN_KILL=1, which writes down every message it sends and receives).

It writes down one thing: the wall-clock ns at which it read its `kill`, in
$HOME/kill_received (the sandbox's work folder, kept by the runner as evidence), so that the
benchmark can time the kill to the daemon without a transcript of every lease.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import websockets

from covey.coveyd import in_a_crowd, step_aside

EXIT_KILLED = 3


def note_kill(received_ns: int) -> None:
    Path(os.environ.get("HOME", "."), "kill_received").write_text(str(received_ns))


async def main() -> int:
    headers = {"Authorization": f"Bearer {os.environ['COVEY_DAEMON_TOKEN']}"}
    async with websockets.connect(os.environ["COVEY_WS_URL"], additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "ready", "payload": {
            "agent_id": os.environ["COVEY_AGENT_ID"],
            "sandbox_id": os.environ["COVEY_SANDBOX_ID"]}}))
        async for raw in ws:
            message = json.loads(raw)
            kind = message["type"]
            if kind == "kill":
                note_kill(time.time_ns())
                # As coveyd does: the kill_ack is its last word, then no closing handshake
                # and no interpreter teardown.
                await ws.send(json.dumps({"type": "kill_ack", "payload": {
                    "stop": "kill", "exit_code": EXIT_KILLED, "detail": "reason kill-switch"}}))
                ws.transport.abort()
                if in_a_crowd(message.get("payload") or {}):
                    step_aside()
                os._exit(EXIT_KILLED)
            if kind == "sleep":
                return 0
    return 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
