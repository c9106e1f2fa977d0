"""A scripted OpenAI-compatible chat-completions endpoint for the daemon's tests. The task
text names the behaviour ("model:identical_loop"); every request is written to a ledger
with wall-clock nanoseconds, per agent (the daemon sends X-Covey-Agent)."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import defaultdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def _call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def _reply(calls: list[dict[str, Any]] | None, content: str | None = None,
           prompt_tokens: int = 100, completion_tokens: int = 20) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:8]}", "object": "chat.completion",
        "created": int(time.time()), "model": "puppet",
        "choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop",
                     "message": {"role": "assistant", "content": content,
                                 **({"tool_calls": calls} if calls else {})}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def behave(behaviour: str, step: int, base_url: str) -> dict[str, Any]:
    if behaviour == "well_behaved":
        script = [_call("write_file", {"path": "notes.txt", "content": "step one\n"}),
                  _call("shell", {"cmd": "cat notes.txt"}),
                  _call("finish", {"result": "wrote notes.txt"})]
        return _reply([script[min(step, 2)]])
    if behaviour == "identical_loop":
        return _reply([_call("shell", {"cmd": "ls -la"})])
    if behaviour == "rm_rf_loop":
        return _reply([_call("shell", {"cmd": "rm -rf ./*"})])
    if behaviour == "ab_cycle":
        return _reply([_call("read_file" if step % 2 == 0 else "write_file",
                             {"path": "a.txt"} if step % 2 == 0 else
                             {"path": "a.txt", "content": "x"})])
    if behaviour == "runaway_spend":
        return _reply([_call("shell", {"cmd": f"echo {step}"})], prompt_tokens=150_000)
    if behaviour == "failing_tool_hammer":
        return _reply([_call("http_request", {"url": f"{base_url}/fail?n={step}"})])
    if behaviour == "write_then_silent":
        if step == 0:
            return _reply([_call("write_file", {"path": "notes.txt", "content": "step two\n"})])
        return _reply([_call("shell", {"cmd": f"sleep 0.2; echo tick {step}"})])
    if behaviour == "print_env":
        return _reply([_call("shell", {"cmd": "env"})] if step == 0 else
                      [_call("finish", {"result": "printed"})])
    if behaviour == "silent":
        return _reply([_call("shell", {"cmd": f"sleep 0.2; echo tick {step}"})])
    return _reply(None, content=f"unknown behaviour {behaviour}")


def create_model() -> tuple[FastAPI, dict[str, list[dict[str, Any]]]]:
    app = FastAPI()
    ledger: dict[str, list[dict[str, Any]]] = defaultdict(list)

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        agent = request.headers.get("x-covey-agent", "?")
        messages = body["messages"]
        task = next(m["content"] for m in messages if m["role"] == "user")
        match = re.search(r"model:(\w+)", task)
        behaviour = match.group(1) if match else "well_behaved"
        step = sum(1 for m in messages if m["role"] == "tool")
        ledger[agent].append({"at_ns": time.time_ns(), "step": step, "behaviour": behaviour,
                              "tool_results": [m["content"] for m in messages
                                               if m["role"] == "tool"][-1:]})
        return JSONResponse(behave(behaviour, step, str(request.base_url).rstrip("/")))

    @app.get("/fail")
    async def fail() -> JSONResponse:
        return JSONResponse({"error": "always failing"}, status_code=500)

    return app, ledger
