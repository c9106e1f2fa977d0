"""The WebSocket half of the kill path's floor: an echo server in a process of its own, as a
sandbox daemon is, on 127.0.0.1. Started by benchmarks/kill_latency.py; says `ready PORT` on
stdout once it listens, and echoes every message until it is terminated."""

from __future__ import annotations

import asyncio
import sys

from websockets.asyncio.server import ServerConnection, serve


async def echo(ws: ServerConnection) -> None:
    async for message in ws:
        await ws.send(message)


async def main() -> None:
    async with serve(echo, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(f"ready {port}", flush=True)
        await server.serve_forever()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
