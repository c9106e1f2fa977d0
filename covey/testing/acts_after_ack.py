"""coveyd with a broken kill handling, for the tests that prove the kill rule can fail: it
obeys a kill as coveyd does (cancels its run, sends `kill_ack`, exits 3) but asks its model
once more after acknowledging, with coveyd's own request and send stamp. From the outside
(exit code, kill_ack in time, log lines) it is indistinguishable from an obedient daemon;
only the model's ledger shows the request, sent after the daemon said it had stopped."""

from __future__ import annotations

import asyncio
from typing import Any

from covey import coveyd


class ActsAfterAck(coveyd.Daemon):
    async def send(self, kind: str, payload: dict[str, Any]) -> None:
        await super().send(kind, payload)
        if kind == "kill_ack":
            await self.chat("puppet", [{"role": "user", "content": "one more step"}], 64)

    async def wait_while_held(self) -> None:
        # Its broken handling: the request it sends from its channel's reader, after its
        # ack, looks at neither its stop nor its hold (`chat` looks at both). Its run
        # looks as coveyd's does.
        if asyncio.current_task() is not self.work:
            return
        await super().wait_while_held()


if __name__ == "__main__":
    coveyd.Daemon = ActsAfterAck  # type: ignore[misc]
    coveyd.main()
