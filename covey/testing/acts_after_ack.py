"""coveyd with a broken kill handling, for the tests that prove the kill rule can fail: it
obeys a kill as coveyd does (cancels its run, sends `kill_ack`, exits 3) but asks its model
once more after acknowledging, with coveyd's own request and send stamp. From the outside
(exit code, kill_ack in time, log lines) it is indistinguishable from an obedient daemon;
only the model's ledger shows the request, sent after the daemon said it had stopped."""

from __future__ import annotations

from typing import Any

from covey import coveyd


class ActsAfterAck(coveyd.Daemon):
    async def send(self, kind: str, payload: dict[str, Any]) -> None:
        await super().send(kind, payload)
        if kind == "kill_ack":
            # Its broken handling: it forgets its stop, and the hold before it, for one
            # request (`chat` checks both).
            self.halted = False
            self.holds.clear()
            try:
                await self.chat("puppet", [{"role": "user", "content": "one more step"}], 64)
            finally:
                self.halted = True


if __name__ == "__main__":
    coveyd.Daemon = ActsAfterAck  # type: ignore[misc]
    coveyd.main()
