"""The one free-port helper draws below the kernel's ephemeral range (where an outgoing
connection could take the port before the server binds it) and never hands out a held port."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from harness.stack import base
from harness.stack.base import FREE_PORTS_FROM, free_port

FIRST_EPHEMERAL = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


@pytest.mark.skipif(FIRST_EPHEMERAL - FREE_PORTS_FROM < 1000,
                    reason="this kernel leaves no room below its ephemeral range")
def test_a_free_port_lies_below_the_ephemeral_range_and_can_be_listened_on() -> None:
    for _ in range(20):
        port = free_port()
        assert FREE_PORTS_FROM <= port < FIRST_EPHEMERAL, (
            f"port {port} is outside {FREE_PORTS_FROM}..{FIRST_EPHEMERAL - 1}")
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
            server.listen()


def test_a_port_held_by_a_listener_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([taken, taken, 0])

        class Drawn(random.Random):
            def randrange(self, *args: object, **kwargs: object) -> int:  # type: ignore[override]
                return next(draws)

        monkeypatch.setattr(base, "_PICK", Drawn())
        monkeypatch.setattr(base, "FREE_PORTS_FROM", 1)  # room below any range: the draws run
        port = free_port()
    assert port != taken
    assert next(draws, None) is None, "free_port returned before drawing past the held port"
