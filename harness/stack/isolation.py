"""Where a game day runs: an organisation of its own, or the one it was given.

The fleet switch stops every agent of an organisation. A game day that shares one with other
game days (or with a staging system's real agents) stops theirs too, and a second run once
failed because the first run's agents were among those its kill stopped. So, given a platform
admin, every game day creates an organisation of its own, named after the game day and its
seed; without one it runs in the given organisation, says so, and judges only its own agents.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness.act.client import json_of
from harness.act.dialect import COVEY_GAMEDAY, sign_in

if TYPE_CHECKING:
    from harness.act.client import CoveyClient

# Every agent a game day creates carries this prefix in its slug, so that a later game day
# in the same organisation can tell agents of game days from the deployment's own.
GAME_DAY_SLUG_PREFIX = "gd-"
SHARED_WARNING = ("runs in the given organisation: the fleet switch will stop every agent "
                  "there, not only the game day's; give --target-platform-email and "
                  "--target-platform-password (or COVEY_TARGET_PLATFORM_EMAIL/_PASSWORD) for "
                  "an organisation of its own per game day")


def isolation_header(stack: str, platform_admin: bool) -> str:
    """The run's header line on where its game days run."""
    if stack != "target" or platform_admin:
        return "every game day runs in a fresh organisation of its own"
    return f"WARNING: every game day {SHARED_WARNING}"


def run_id() -> str:
    """Tells two runs of the same game day and seed apart (names must be unique)."""
    return uuid.uuid4().hex[:6]


def agent_slug(run: str, index: int, words: str) -> str:
    return f"{GAME_DAY_SLUG_PREFIX}{run}-{index}-{words}"[:64].rstrip("-")


def is_game_day_agent(slug: str) -> bool:
    return slug.startswith(GAME_DAY_SLUG_PREFIX)


@dataclass(frozen=True)
class Organisation:
    id: str
    name: str
    admin_email: str
    admin_password: str
    own: bool  # created for this game day alone

    @property
    def warning(self) -> str | None:
        return None if self.own else SHARED_WARNING

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "own": self.own,
                "admin_email": self.admin_email, "warning": self.warning}


def org_name(game_day: str, seed: int, run: str) -> str:
    return f"{game_day} seed {seed} run {run}"[:100]


async def organisation_for(url: str, admin_email: str, admin_password: str,
                           platform_email: str | None, platform_password: str | None,
                           game_day: str, seed: int, run: str,
                           dialect: str = COVEY_GAMEDAY) -> Organisation:
    """A fresh organisation with its own admin when a platform admin is given, else the
    organisation of the given admin."""
    if platform_email and platform_password:
        name = org_name(game_day, seed, run)
        email = f"admin.{run}.{seed}@gameday.test"
        password = f"game-day-{uuid.uuid4().hex}"
        platform = await sign_in(dialect, url, platform_email, platform_password)
        try:
            created = json_of(await platform.create_org(name, email, password), 201)
        finally:
            await platform.aclose()
        return Organisation(str(created["id"]), name, email, password, own=True)
    admin = await sign_in(dialect, url, admin_email, admin_password)
    try:
        me = json_of(await admin.me())
    finally:
        await admin.aclose()
    return Organisation(str(me["org_id"]), f"the organisation of {admin_email}",
                        admin_email, admin_password, own=False)


async def strangers_stopped(organisation: Organisation | None, auditor: CoveyClient,
                            mine: set[str], stopped: set[str]) -> str | None:
    """What is wrong with the agents a fleet kill stopped besides the game day's own (those
    in `organisation`, read by `auditor`), or None. In an organisation of its own there must
    be none. In a shared one the deployment's own agents are stopped too (that is what the
    switch does), but an agent of another game day still running means that game day's
    rollback failed."""
    strangers = stopped - mine
    if not strangers:
        return None
    if organisation is not None and organisation.own:
        return (f"the fleet stop stopped {len(strangers)} agents that are not this game day's "
                f"in its own organisation: {sorted(strangers)}")
    agents = {a["id"]: a for a in json_of(await auditor.agents())}
    leftovers = sorted(agents[a]["slug"] for a in strangers
                       if a in agents and is_game_day_agent(agents[a]["slug"]))
    if leftovers:
        return (f"the fleet stop found agents of earlier game days still running (their "
                f"rollback did not stop them): {leftovers}")
    return None
