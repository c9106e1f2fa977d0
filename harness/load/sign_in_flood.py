"""A sign-in flood (issue 23): concurrent loops of wrong-password sign-ins against one control
plane, from a process of its own, so that the flood's own HTTP work does not run on the event
loop of a plane served in the caller's process.

    python -m harness.load.sign_in_flood --url http://127.0.0.1:PORT --email E [--loops 16]

It prints `flooding` once every loop has had an answer, floods until its standard input
closes, then prints what it was answered as one JSON line:
{"attempts": n, "answers": {"401": n, "429": n, ...}}. `flood` runs it so from a caller.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx

READY = "flooding"


async def _flood(url: str, email: str, loops: int) -> Counter[str]:
    answers: Counter[str] = Counter()
    answered: set[int] = set()
    everyone = asyncio.Event()

    async def loop(i: int, client: httpx.AsyncClient) -> None:
        while True:
            try:
                r = await client.post("/api/v1/auth/login",
                                      json={"email": email, "password": f"wrong guess {i}"})
                answers[str(r.status_code)] += 1
            except httpx.HTTPError as exc:
                answers[type(exc).__name__] += 1
            answered.add(i)
            if len(answered) == loops:
                everyone.set()

    limits = httpx.Limits(max_connections=loops, max_keepalive_connections=loops)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        running = [asyncio.create_task(loop(i, client)) for i in range(loops)]
        try:
            await everyone.wait()
            print(READY, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
    return answers


@contextlib.asynccontextmanager
async def flood(url: str, email: str, loops: int) -> AsyncIterator[dict[str, Any]]:
    """The flood runs for as long as the block does; the dict it yields is filled, once the
    block is over, with what the flood was answered (`attempts`, `answers`)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "harness.load.sign_in_flood", "--url", url, "--email", email,
        "--loops", str(loops), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    outcome: dict[str, Any] = {}
    try:
        async with asyncio.timeout(60):
            line = (await process.stdout.readline()).decode().strip()
        if line != READY:
            raise RuntimeError(f"the sign-in flood did not start: {line!r}")
        yield outcome
    finally:
        process.stdin.close()
        try:
            async with asyncio.timeout(30):
                out, _ = await process.communicate()
            outcome.update(json.loads(out.decode().strip().splitlines()[-1]))
        except (TimeoutError, ValueError, IndexError):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--email", required=True)
    parser.add_argument("--loops", type=int, default=16)
    args = parser.parse_args()
    answers = asyncio.run(_flood(args.url, args.email, args.loops))
    print(json.dumps({"attempts": sum(answers.values()), "answers": dict(answers)}), flush=True)


if __name__ == "__main__":
    main()
