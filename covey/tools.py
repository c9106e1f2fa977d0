"""The tools an agent may call, acting inside its sandbox home. Each returns a JSON-able
result and whether the call succeeded (the circuit breaker counts failures)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

OUTPUT_CAP = 16_000
FILE_CAP = 64_000
SHELL_TIMEOUT_MAX_S = 120.0

SCHEMAS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "shell", "description": "Run a shell command in the sandbox home.",
        "parameters": {"type": "object", "properties": {
            "cmd": {"type": "string"}, "timeout_s": {"type": "number"}},
            "required": ["cmd"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file under the sandbox home.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a file under the sandbox home.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "http_request", "description": "Make an HTTP request.",
        "parameters": {"type": "object", "properties": {
            "method": {"type": "string"}, "url": {"type": "string"},
            "body": {"type": "string"}}, "required": ["url"]}}},
    {"type": "function", "function": {
        "name": "finish", "description": "Report the task done, with its result.",
        "parameters": {"type": "object", "properties": {"result": {"type": "string"}},
                       "required": ["result"]}}},
]


class ToolError(Exception):
    """The call itself was wrong (unknown tool, bad arguments, path outside home)."""


@dataclass
class Toolbox:
    home: Path
    http: httpx.AsyncClient

    def _inside(self, path: Any) -> Path:
        if not isinstance(path, str) or not path:
            raise ToolError("path must be a non-empty string")
        resolved = (self.home / path).resolve()
        if not resolved.is_relative_to(self.home.resolve()):
            raise ToolError(f"{path} is outside the sandbox home")
        return resolved

    async def run(self, name: str, args: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        try:
            if name == "shell":
                return await self.shell(args)
            if name == "read_file":
                path = self._inside(args.get("path"))
                if not path.is_file():
                    return {"error": f"no such file: {args.get('path')}"}, False
                text = path.read_text(errors="replace")
                return {"content": text[:FILE_CAP], "truncated": len(text) > FILE_CAP}, True
            if name == "write_file":
                path = self._inside(args.get("path"))
                content = args.get("content")
                if not isinstance(content, str):
                    raise ToolError("content must be a string")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content)
                return {"written": len(content)}, True
            if name == "http_request":
                return await self.http_request(args)
        except (ToolError, ValueError, UnicodeError) as exc:
            # ValueError, UnicodeError: a model's NUL in a path or a command ("embedded null
            # byte"), its lone surrogate in a file's content. The model hears it as the tool's
            # error; it once escaped as the daemon's, and failed the task after five requeues.
            return {"error": str(exc)}, False
        return {"error": f"unknown tool {name!r}"}, False

    async def shell(self, args: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        cmd = args.get("cmd")
        if not isinstance(cmd, str) or not cmd.strip():
            raise ToolError("cmd must be a non-empty string")
        timeout = args.get("timeout_s", 30)
        if not isinstance(timeout, int | float) or not 0 < timeout <= SHELL_TIMEOUT_MAX_S:
            timeout = 30
        proc = await asyncio.create_subprocess_shell(
            cmd, cwd=self.home, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            return {"error": f"timed out after {timeout}s"}, False
        except asyncio.CancelledError:
            # A kill cancels the run: whatever the command started dies with it.
            _kill_group(proc.pid)
            raise
        text = out.decode(errors="replace")
        return ({"exit_code": proc.returncode, "output": text[:OUTPUT_CAP],
                 "truncated": len(text) > OUTPUT_CAP}, proc.returncode == 0)

    async def http_request(self, args: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        url, method = args.get("url"), str(args.get("method", "GET")).upper()
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ToolError("url must be an http(s) URL")
        body = args.get("body")
        try:
            r = await self.http.request(method, url, content=body if isinstance(body, str)
                                        else None, timeout=10)
        except httpx.HTTPError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}, False
        return ({"status": r.status_code, "body": r.text[:OUTPUT_CAP]}, r.status_code < 500)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
