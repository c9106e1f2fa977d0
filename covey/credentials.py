"""Who a credential is, remembered between requests while this replica hears every change.

Every request looked its caller up: one round trip to Postgres before anything else, a kill's
too. On a quiet host that was a tenth of a single kill's time to its daemon
(benchmarks.kill_latency), and under 200 operators' reads it was one more statement each
for a busy database.

A remembered caller is forgotten as soon as anything that could change the answer is
announced. Whoever writes the row (a logout, a revoked token, a change of role or email, an
operator with psql), a trigger announces the human on `covey_credentials` (migrations 0013
and 0024; a TRUNCATE announces everyone), and the listening connection (covey.app.Listener)
hands it to `announced`. Only a writer that turns triggers off
(`session_replication_role = replica`) goes unheard, until `TTL_S`. The writes this replica makes
itself are forgotten at once by their routes as well (`changed` again), not when their own
announcement comes back: a logout's next request must be refused on this replica, whatever
the listener's delay.

Nothing is remembered while the announcements cannot be heard: not before the listening
connection is up, not after it is lost, and not a caller read while an announcement arrived
or the connection changed (`epoch`), which could be a caller from before it. A connection
that dies without a word is found by its 5 s ping; `TTL_S` bounds what it could miss. A
session's own expiry bounds its entry too. Unknown credentials are never remembered.

The API tokens of whoever may pull a switch are remembered ahead of their use
(`keep_switch_callers`, every SWITCH_CALLERS_EVERY_S), under the same rules: a kill from a
token that has asked for nothing lately does not wait for its caller's look-up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from uuid import UUID

if TYPE_CHECKING:
    from covey.db import Pool

# How long a caller is remembered at most, announcements heard or not.
TTL_S = 10.0
# Callers remembered at once at most; past it everything is forgotten and read again.
LIMIT = 10_000
# The API tokens of the humans who may pull a switch are read again this often, whether or
# not they have been used (`keep_switch_callers`), so that each stays remembered; at most this
# many, the newest (well under LIMIT: a pass must not forget everyone by itself). Not the web
# sessions: a console in use asks for its page every 3 s (admin.js), and sessions that ended
# by their expiry stay in their table, which this would read in full. A pass waits at most
# SWITCH_CALLERS_EVERY_S for a connection of the reads' pool, and as long for its answer.
SWITCH_CALLERS_EVERY_S = TTL_S / 2
SWITCH_CALLERS_LIMIT = 1_000
assert SWITCH_CALLERS_LIMIT < LIMIT
# What makes an API token valid, as covey.api.deps.CALLER_SQL says it: change both together.
SWITCH_CALLERS_SQL = """
    SELECT t.token_hash, h.id, h.org_id, h.email, h.role
    FROM api_tokens t JOIN humans h ON h.id = t.human_id
    WHERE h.role = ANY($1::text[])
    ORDER BY t.created_at DESC
    LIMIT $2
    """


@dataclass(frozen=True)
class Principal:
    human_id: UUID
    org_id: UUID
    email: str
    role: str


class Credentials:
    """Credential hash -> the caller it was, while this replica hears every change."""

    def __init__(self, ttl_s: float = TTL_S, limit: int = LIMIT) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._callers: dict[str, tuple[Principal, float]] = {}
        self._hearing = False
        # Bumped by everything that makes a caller read before it stale.
        self.epoch = 0

    def listening(self, hearing: bool) -> None:
        """The listening connection is up (True) or lost (False): forget everyone either
        way (what was announced while it was down was not heard)."""
        self._hearing = hearing
        self.epoch += 1
        self._callers.clear()

    def changed(self, human_id: UUID | None) -> None:
        """This replica changed this human's credentials (everyone's for None): forget
        their callers now, before the announcement comes back."""
        self.epoch += 1
        if human_id is None:
            self._callers.clear()
            return
        for hashed in [h for h, (who, _) in self._callers.items() if who.human_id == human_id]:
            del self._callers[hashed]

    def announced(self, human_id: UUID | None) -> None:
        """A change to this human's credentials (everyone's for None) was announced on
        `covey_credentials`, whoever wrote it: forget their callers."""
        self.changed(human_id)

    def get(self, hashed: str) -> Principal | None:
        entry = self._callers.get(hashed)
        if entry is None:
            return None
        who, until = entry
        if time.monotonic() >= until:
            del self._callers[hashed]
            return None
        return who

    @property
    def hearing(self) -> bool:
        return self._hearing

    def remember(self, hashed: str, who: Principal, left_s: float | None, epoch: int) -> None:
        """Remember `who`, read when `epoch` was current, for at most `left_s` (the session's
        time left; None for an API token)."""
        if not self._hearing or epoch != self.epoch:
            return
        if len(self._callers) >= self.limit:
            self._callers.clear()
        held_s = self.ttl_s if left_s is None else min(self.ttl_s, left_s)
        self._callers[hashed] = (who, time.monotonic() + held_s)


async def keep_switch_callers(pool: Pool, credentials: Credentials, roles: Sequence[str]
                              ) -> int:
    """Read the API tokens of the humans whose role may pull a switch (`roles`) and remember
    their callers, as a request of theirs would; returns how many. A kill from a token that
    had asked for nothing within TTL_S (a shell's `curl`, a pager's automation) looked its
    caller up on the kill's own path, in a Postgres busy with the operators' reads: in 8
    incident-load game days the fleet kill's first `hold` went out 2.9-14.5 ms after the
    request reached the plane (median 4.8), and 0.9-2.1 ms (1.3) in 8 beside them with this.
    What a request's look-up guarantees holds here too: nothing is remembered while
    announcements cannot be heard, nor read across one (`epoch`), nor for longer than
    TTL_S."""
    if not credentials.hearing:
        return 0
    epoch = credentials.epoch
    async with pool.acquire(timeout=SWITCH_CALLERS_EVERY_S) as conn:
        rows = await conn.fetch(SWITCH_CALLERS_SQL, list(roles), SWITCH_CALLERS_LIMIT,
                                timeout=SWITCH_CALLERS_EVERY_S)
    for row in rows:
        credentials.remember(row["token_hash"], Principal(row["id"], row["org_id"],
                                                          row["email"], row["role"]),
                             None, epoch)
    return len(rows)
