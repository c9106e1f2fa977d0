"""Container faults, through the Docker engine: pause, stop and disconnect stand until healed
(each with a watchdog that heals it after the deadline even if the harness is gone); a kill
is over once delivered. The engine's calls block, so each runs in a thread; the engine's
errors (docker.errors.NotFound for an unknown container, APIError for a refused call) pass
through and leave no fault behind."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from harness.nemesis.faults import BadFault, FaultKind, HealFailed
from harness.nemesis.standing import Fault
from harness.nemesis.watchdog import HealOrder, carry_out

if TYPE_CHECKING:
    from docker.models.containers import Container
    from docker.models.networks import Network

MAX_STOP_TIMEOUT_S = 600  # docker stop's grace period before its SIGKILL
_UNDO: dict[str, str] = {"pause": "unpause", "stop": "start", "disconnect": "reconnect"}


def check_stop_timeout(timeout_s: int) -> None:
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, int)
            or not 0 <= timeout_s <= MAX_STOP_TIMEOUT_S):
        raise BadFault("Invalid timeout_s",
                       f"timeout_s must be a whole number of seconds, >= 0 and <= "
                       f"{MAX_STOP_TIMEOUT_S}, not {timeout_s!r}: how long docker stop waits "
                       "after the stop signal before it kills.")


def identity(container: Container) -> tuple[str, str]:
    """(full id, name) of a container as the engine returned it."""
    key = container.id
    assert key is not None, "a container from the engine always has an id"
    return key, container.name or container.short_id


def network_settings(container: Container, network_id: str) -> dict[str, Any] | None:
    """The container's endpoint on a network (its full id), as of the container's last
    inspect; None when it is not on that network."""
    networks = (container.attrs.get("NetworkSettings") or {}).get("Networks") or {}
    for settings in networks.values():
        if settings.get("NetworkID") == network_id:
            return dict(settings)
    return None


def reconnect_settings(container: Container, settings: dict[str, Any]) -> dict[str, Any]:
    """`Network.connect()`'s arguments that put the container back as it was: its aliases
    (without its short id, which the engine adds itself) and any static addresses."""
    reconnect: dict[str, Any] = {}
    aliases = [a for a in settings.get("Aliases") or [] if a != container.short_id]
    if aliases:
        reconnect["aliases"] = aliases
    ipam = settings.get("IPAMConfig") or {}
    if ipam.get("IPv4Address"):
        reconnect["ipv4_address"] = ipam["IPv4Address"]
    if ipam.get("IPv6Address"):
        reconnect["ipv6_address"] = ipam["IPv6Address"]
    if ipam.get("LinkLocalIPs"):
        reconnect["link_local_ips"] = ipam["LinkLocalIPs"]
    return reconnect


class ContainerFault(Fault):
    """A standing fault of one container; `key` is its full id (its name may pass to another
    container meanwhile)."""

    def __init__(self, container: Container, kind: FaultKind, *, timeout_s: int = 10,
                 network: Network | None = None,
                 reconnect: dict[str, Any] | None = None) -> None:
        self.container = container
        self.kind = kind
        self.key, self.name = identity(container)
        self.target = f"container {self.name}"
        self.id_prefix = f"container-{self.name}"
        self.timeout_s = timeout_s
        self.network_obj = network
        self.network_id = None if network is None else network.id
        self.network = None if network is None else (network.name or network.short_id)
        # Known before the fault starts: its watchdog's heal order carries it.
        self.reconnect: dict[str, Any] = reconnect or {}

    def not_on_it(self) -> BadFault:
        return BadFault("Not on the network",
                        f"container {self.name} is not connected to network {self.network}: "
                        "connect it first, or name a network it is on.")

    async def impose(self) -> str | None:
        await asyncio.to_thread(self._impose)
        return None

    def _impose(self) -> None:
        if self.kind == "pause":
            self.container.pause()
        elif self.kind == "stop":
            self.container.stop(timeout=self.timeout_s)
        elif self.kind == "disconnect":
            assert self.network_obj is not None and self.network_id is not None
            self.container.reload()  # as it is now, after the heal of a fault this replaced
            if network_settings(self.container, self.network_id) is None:
                raise self.not_on_it()
            self.network_obj.disconnect(self.container)

    async def lift(self) -> str | None:
        try:
            return await asyncio.to_thread(carry_out, self.heal_order())
        except Exception as e:  # whatever stops the heal (container or network gone, engine)
            raise HealFailed(f"could not {_UNDO[self.kind]} container {self.name}: {e}") from e

    def heal_order(self) -> HealOrder:
        order: HealOrder = {"do": "docker", "action": _UNDO[self.kind], "container": self.key}
        if self.kind == "disconnect":
            order |= {"network": self.network_id, "reconnect": self.reconnect}
        return order


class ContainerKill(Fault):
    kind: FaultKind = "kill"

    def __init__(self, container: Container) -> None:
        self.key, name = identity(container)
        self.target = f"container {name}"
        self.id_prefix = f"container-{name}"
