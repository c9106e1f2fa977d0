"""The `target` stack: nothing started; an existing deployment given by URL and
credentials."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from harness.act.puppet import LocalPuppet, Puppet
from harness.stack.base import Endpoints, lease_of, serve_puppet, wait_until_healthy


@dataclass
class TargetStack:
    """An existing deployment: nothing is started or stopped. Its sandboxes must reach the
    puppet model that this harness serves on `puppet_port` (start the deployment with
    COVEY_MODEL_URL=http://127.0.0.1:PORT/v1), and the credentials must be an org admin's."""

    url: str
    admin_email: str
    admin_password: str
    puppet_port: int | None = None
    platform_email: str | None = None
    platform_password: str | None = None
    name: str = "target"

    @asynccontextmanager
    async def up(self) -> AsyncIterator[Endpoints]:
        health = await wait_until_healthy(self.url.rstrip("/"), 30)
        puppet = Puppet()
        async with serve_puppet(puppet, self.puppet_port) as puppet_url:
            yield Endpoints(self.url.rstrip("/"), self.admin_email, self.admin_password,
                            LocalPuppet(puppet), puppet_url, {"covey": health.get("version", "?"),
                                         "python": sys.version.split()[0]},
                            platform_email=self.platform_email,
                            platform_password=self.platform_password,
                            lease_ms=lease_of(health))


# Postgres from the stack's own image: initdb, trust the game day's network (it is the game
# day's alone), fsync off (a game day's database is thrown away).
