"""The `target` stack: nothing started; an existing deployment given by URL and
credentials, speaking this project's dialect or upstream covey's (harness/act/dialect.py)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from harness.act.dialect import AUTO, UPSTREAM, detect, server_version, sign_in
from harness.act.puppet import LocalPuppet, Puppet
from harness.act.upstream import MockDirectives
from harness.record.sandbox_events import SandboxWatch, watching
from harness.stack.base import Endpoints, lease_of, serve_puppet, wait_until_healthy


@dataclass
class TargetStack:
    """An existing deployment: nothing is started or stopped. Its sandboxes must reach the
    puppet model that this harness serves on `puppet_port` (start the deployment with
    COVEY_MODEL_URL=http://127.0.0.1:PORT/v1), and the credentials must be an org admin's.
    Upstream covey's agents run its `mock` engine instead, steered by their task bodies."""

    url: str
    admin_email: str
    admin_password: str
    puppet_port: int | None = None
    platform_email: str | None = None
    platform_password: str | None = None
    name: str = "target"
    dialect: str = AUTO

    @asynccontextmanager
    async def up(self) -> AsyncIterator[Endpoints]:
        url = self.url.rstrip("/")
        await wait_until_healthy(url, 30)
        spoken = await detect(url, self.dialect)
        if spoken.dialect == UPSTREAM:
            admin = await sign_in(UPSTREAM, url, self.admin_email, self.admin_password)
            try:
                versions = await server_version(admin, spoken.health)
            finally:
                await admin.aclose()
            # Its sandboxes are evidence only in the Docker engine's events: followed from
            # before the first agent exists.
            watch = SandboxWatch()
            await asyncio.to_thread(watch.start)
            with watching(watch):
                yield Endpoints(url, self.admin_email, self.admin_password, MockDirectives(),
                                "none: upstream's mock engine asks no model",
                                {**versions, "python": sys.version.split()[0]},
                                dialect=UPSTREAM)
            return
        puppet = Puppet()
        async with serve_puppet(puppet, self.puppet_port) as puppet_url:
            yield Endpoints(url, self.admin_email, self.admin_password,
                            LocalPuppet(puppet), puppet_url,
                            {"covey": spoken.health.get("version", "?"),
                             "python": sys.version.split()[0]},
                            platform_email=self.platform_email,
                            platform_password=self.platform_password,
                            lease_ms=lease_of(spoken.health), dialect=spoken.dialect)
