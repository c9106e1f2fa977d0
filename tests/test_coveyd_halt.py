"""A kill whose cancellation is lost still stops the daemon's run (one unit: the engine of
`covey.coveyd`, with its model, tools and channel stood in for)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.coveyd import Daemon, Env
from covey.tools import Toolbox


class Channel:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def send(self, text: str) -> None:
        self.sent.append(json.loads(text)["type"])


async def test_a_kill_swallowed_as_a_tool_call_returns_still_ends_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = Env(ws_url="ws://127.0.0.1:1", token="t", agent_id="a1", sandbox_id="s1",
              model_url="http://127.0.0.1:1/v1", model_key="none",
              prices={"puppet": (0.0, 0.0)}, home=tmp_path)
    async with httpx.AsyncClient() as http:
        daemon = Daemon(env, Channel(), http)  # type: ignore[arg-type]
        daemon.config = {"guard": {"max_steps": 50}, "budget_usd": 1.0}
        daemon.flag.renew(60)
        model_calls = 0

        async def chat(model: str, messages: list[dict[str, Any]], max_tokens: int
                       ) -> dict[str, Any]:
            nonlocal model_calls
            model_calls += 1
            call = {"id": f"c{model_calls}", "type": "function",
                    "function": {"name": "shell", "arguments": json.dumps(
                        {"cmd": f"echo {model_calls}"})}}
            return {"choices": [{"message": {"role": "assistant", "tool_calls": [call]}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

        async def run(_self: Toolbox, name: str, args: dict[str, Any]
                      ) -> tuple[dict[str, Any], bool]:
            daemon.stop_work("reason kill-switch")  # the kill lands as the call returns,
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass  # and is swallowed, as Python 3.11's wait_for does at that instant
            return {"exit_code": 0, "output": "", "truncated": False}, True

        monkeypatch.setattr(daemon, "chat", chat)
        monkeypatch.setattr(Toolbox, "run", run)
        daemon.work = asyncio.create_task(daemon.run_task(
            {"task_id": "t1", "fencing_token": 1, "title": "t", "body": ""}))
        done, _ = await asyncio.wait({daemon.work}, timeout=5)
        assert done, "the stopped run went on working"
        assert daemon.work.cancelled(), "the stopped run ended some other way"
        assert model_calls == 1, (
            f"the daemon asked its model {model_calls - 1} more time(s) after it was killed")
        sent = daemon.ws.sent  # type: ignore[attr-defined]
        assert "task_done" not in sent, "a killed run reported its task done"
