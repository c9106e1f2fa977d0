"""The operators' switch requests, sent from a process of their own at the control plane's
CPU priority.

A game day's harness plays the operator on the host of the fleet it stops. Under incident
load (20 busy agents, 64 operators' reads, two cores) the harness waited for a CPU between
its stamp of the operator's request and the request's write: a median 5.8 ms and up to 37 ms
(docs/BENCHMARKS.md, the eighth pass), counted against the switch, although an operator's
terminal is not the fleet's host. The stamp stays where it is (recorder.operate, the instant
before the call): from there, a switch request goes into this process's pipe without the
harness's event loop turning once (`SwitchRouting` writes it at once), and this process,
idle until then and weighed as the plane is (its autogroup at LINE_NICE), sends it on that
human's own connections.

Only the requests a scenario marks as switches (`SWITCH` in the request's extensions: a
kill, a stop) take this way; every read and every other write stays in the harness, so the
priority lends nothing to the load. What the wire says is the harness's own request: its
method, URL, headers (the human's token or cookie) and body, sent with a kept-alive
connection pool for each human, as the harness's clients keep theirs. A request the line
cannot send comes back as the httpx error the harness would have met; when the line itself
is gone the request may have left, and the harness says it does not know (a read error,
recorded as info).

    python -m harness.act.switch_line   # frames on stdin, answers on stdout (JSON lines)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.cookiejar
import itertools
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

SWITCH = "covey_gameday_switch"  # the request extension that sends a request down the line
# The nice value of the control plane's autogroup (covey.config.PLANE_NICE): the operator's
# requests weigh as much as the plane that serves them, and no more.
LINE_NICE = -10
AUTOGROUP = Path("/proc/self/autogroup")
AT_ONCE = 8  # switch requests in flight at once (one per human pulling at the same instant)
UNFRAMED = (b"content-encoding", b"content-length", b"transfer-encoding")


def switch(extensions: dict[str, Any] | None = None) -> dict[str, Any]:
    """The extensions that mark a request as a switch pulled by an operator."""
    return {**(extensions or {}), SWITCH: True}


@dataclass(frozen=True)
class Priority:
    nice: int | None  # None: the line runs at the harness's priority
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"nice": self.nice, "reason": self.reason}


class SwitchLine:
    """The line's process, seen from the harness: `send` one request, await its answer."""

    def __init__(self, process: asyncio.subprocess.Process, priority: Priority) -> None:
        self.process, self.priority = process, priority
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reading = asyncio.create_task(self._read_answers())

    @classmethod
    async def start(cls, log: Path) -> SwitchLine:
        """The line, ready to send; its stderr appended to `log`."""
        with log.open("ab") as err:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "harness.act.switch_line",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
                # A session of its own, so that its autogroup (and so its priority) is its own.
                start_new_session=True)
        assert process.stdout is not None
        try:
            first = await asyncio.wait_for(process.stdout.readline(), 30)
            ready = json.loads(first)
        except (TimeoutError, json.JSONDecodeError) as exc:
            process.kill()
            await process.wait()
            raise RuntimeError(f"the switch line did not start ({exc!r}); its log: {log}") \
                from None
        return cls(process, Priority(ready["nice"], ready["reason"]))

    def enlist(self, human: int) -> None:
        """Have the line make `human`'s client now, not on their first switch: making one
        took 45-190 ms on a loaded host, which would have counted against the switch."""
        if self.process.stdin is not None and not self._reading.done():
            self.process.stdin.write(json.dumps({"human": human}).encode() + b"\n")

    async def send(self, request: httpx.Request, human: int) -> httpx.Response:
        """Write the request into the line now (no await before the write: the operator's
        stamp was taken just before), then wait for its answer. `human`: whose connections
        it may reuse (each human's client keeps its own, as in the harness)."""
        if self._reading.done() or self.process.stdin is None:
            raise httpx.ConnectError("the switch line has exited: the request was not sent",
                                     request=request)
        number = next(self._ids)
        answered = self._waiting[number] = asyncio.get_running_loop().create_future()
        timeout = request.extensions.get("timeout", {})
        frame = {"id": number, "human": human, "method": request.method,
                 "url": str(request.url),
                 "headers": [[k.decode("latin-1"), v.decode("latin-1")]
                             for k, v in request.headers.raw],
                 "body": base64.b64encode(request.read()).decode(),
                 "timeout": {k: timeout.get(k) for k in ("connect", "read", "write", "pool")}}
        self.process.stdin.write(json.dumps(frame).encode() + b"\n")
        try:
            answer = await answered
        finally:
            self._waiting.pop(number, None)
        if "error" in answer:
            raise _error(answer["error"], answer["message"], request)
        return httpx.Response(answer["status"], headers=answer["headers"],
                              content=base64.b64decode(answer["body"]), request=request)

    async def _read_answers(self) -> None:
        assert self.process.stdout is not None
        try:
            while line := await self.process.stdout.readline():
                answer = json.loads(line)
                waiting = self._waiting.get(answer["id"])
                if waiting is not None and not waiting.done():
                    waiting.set_result(answer)
        finally:
            gone = {"error": "ReadError", "message": "the switch line exited before the "
                    "answer came: the request may have reached the control plane"}
            for waiting in self._waiting.values():
                if not waiting.done():
                    waiting.set_result(gone)

    async def aclose(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
        await self._reading


def _error(name: str, message: str, request: httpx.Request) -> httpx.HTTPError:
    """The httpx error the line met, as the harness would have met it itself."""
    kind = getattr(httpx, name, None)
    if isinstance(kind, type) and issubclass(kind, httpx.RequestError):
        return kind(message, request=request)
    return httpx.TransportError(f"{name}: {message}", request=request)


_humans = itertools.count(1)


class SwitchRouting(httpx.AsyncBaseTransport):
    """A client's transport: switch requests down the line, the rest as usual."""

    def __init__(self, line: SwitchLine, rest: httpx.AsyncBaseTransport | None = None) -> None:
        self.line, self.rest = line, rest or httpx.AsyncHTTPTransport()
        self.human = next(_humans)
        line.enlist(self.human)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.extensions.get(SWITCH):
            return await self.line.send(request, self.human)
        return await self.rest.handle_async_request(request)

    async def aclose(self) -> None:
        await self.rest.aclose()


# ---------------------------------------------------------------------- the line's process

def raise_priority(nice: int, autogroup: Path = AUTOGROUP) -> Priority:
    """This session's autogroup at `nice` where the kernel lets it (root, a session leader,
    autogroups on and weighing here), else the reason it runs at the harness's priority."""
    if os.getsid(0) != os.getpid():
        return Priority(None, "the line does not lead its session")
    try:
        autogroup.write_text(f"{nice}\n")
    except OSError as exc:
        return Priority(None, f"its autogroup's nice value was refused: {exc}")
    return Priority(nice, f"its autogroup at nice {nice}, as the control plane's")


class _NoCookies(http.cookiejar.DefaultCookiePolicy):
    """Each human's cookie travels in the harness's request, which keeps it; the line keeps
    none of its own."""

    def set_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False


def _send(http: httpx.Client, frame: dict[str, Any]) -> dict[str, Any]:
    try:
        r = http.request(frame["method"], frame["url"], headers=frame["headers"],
                         content=base64.b64decode(frame["body"]),
                         timeout=httpx.Timeout(**frame["timeout"]))
    except httpx.HTTPError as exc:
        return {"id": frame["id"], "error": type(exc).__name__, "message": str(exc)}
    # The body goes back decoded: its encoding and length headers would no longer be true.
    return {"id": frame["id"], "status": r.status_code,
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in r.headers.raw
                        if k.lower() not in UNFRAMED],
            "body": base64.b64encode(r.content).decode()}


def main() -> None:
    priority = raise_priority(LINE_NICE)
    out = sys.stdout.buffer
    writing = threading.Lock()

    def answer(reply: dict[str, Any]) -> None:
        with writing:
            out.write(json.dumps(reply).encode() + b"\n")
            out.flush()

    # One client per human, as in the harness: a switch reuses only its own human's kept-alive
    # connection, never one another human's request opened a moment before. Each is made
    # when its human is enlisted, with one TLS context made here (loading the CA bundle is
    # most of what making a client costs).
    verify = httpx.create_ssl_context()
    httpx.Client(verify=verify).close()  # the first client of a process also pays for imports
    clients: dict[int, httpx.Client] = {}
    answer(priority.to_json())
    with ThreadPoolExecutor(AT_ONCE, thread_name_prefix="switch") as pool:
        for line in sys.stdin.buffer:  # ends when the harness closes the pipe (or dies)
            frame = json.loads(line)
            human = frame["human"]
            if human not in clients:
                clients[human] = httpx.Client(
                    verify=verify, follow_redirects=False,
                    cookies=http.cookiejar.CookieJar(policy=_NoCookies()))
            if "id" in frame:
                pool.submit(lambda f, c: answer(_send(c, f)), frame, clients[human])
    for client in clients.values():
        client.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        main()
