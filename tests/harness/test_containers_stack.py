"""The containers stack cleans up after itself: on a normal end, on Ctrl-C, and (through the
next run's reaping) after the harness was killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from harness.stack.containers import reap_stale_game_days

pytestmark = pytest.mark.docker
REPO = Path(__file__).resolve().parents[2]

UP_AND_WAIT = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from harness.stack.containers import ContainersStack

    async def main() -> None:
        async with ContainersStack(Path(sys.argv[1])).up() as endpoints:
            print("UP", endpoints.url, flush=True)
            await asyncio.sleep(600)

    asyncio.run(main())
""")


def _bring_up(tmp_path: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", UP_AND_WAIT, str(tmp_path)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert child.stdout is not None
    deadline = time.monotonic() + 180
    lines = []
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("UP "):
            return child
    child.kill()
    raise AssertionError("the containers stack never came up:\n" + "".join(lines[-40:]))


def _owned_by(client: Any, pid: int) -> tuple[list[Any], list[Any]]:
    label = f"covey.owner_pid={pid}"
    return (client.containers.list(ignore_removed=True, all=True, filters={"label": label}),
            client.networks.list(filters={"label": label}))


def _of_game_day(client: Any, gameday: str) -> list[Any]:
    return list(client.containers.list(ignore_removed=True, all=True,
                                       filters={"label": f"covey.gameday={gameday}"}))


def test_an_interrupted_run_leaves_nothing_behind(docker_client: Any, tmp_path: Path) -> None:
    child = _bring_up(tmp_path)
    containers, networks = _owned_by(docker_client, child.pid)
    assert len(containers) == 4 and len(networks) == 1  # postgres, puppet, proxy, plane
    gameday = containers[0].labels["covey.gameday"]
    child.send_signal(signal.SIGINT)  # Ctrl-C
    assert child.wait(timeout=120) != 0
    assert _of_game_day(docker_client, gameday) == []
    assert _owned_by(docker_client, child.pid) == ([], [])


def test_a_killed_harness_is_reaped_by_the_next_run(docker_client: Any, tmp_path: Path
                                                    ) -> None:
    child = _bring_up(tmp_path)
    containers, _ = _owned_by(docker_client, child.pid)
    gameday = containers[0].labels["covey.gameday"]
    child.kill()  # no finally, no cleanup: as after a crash or SIGKILL
    child.wait(timeout=30)
    assert _of_game_day(docker_client, gameday), "nothing was left to reap"
    assert gameday in reap_stale_game_days()
    assert _of_game_day(docker_client, gameday) == []
    assert _owned_by(docker_client, child.pid) == ([], [])


async def test_a_published_port_taken_before_docker_binds_it_is_picked_again(
        docker_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clean-clone CI run's set-up failed: Docker refused the loopback port the stack had
    picked a moment earlier ("port is already allocated"). The stack picks another."""
    import harness.stack.containers as stack
    from harness.stack.base import free_port

    taken = free_port()
    holder = docker_client.containers.run(
        stack.ContainersStack(tmp_path).image, ["sleep", "300"], detach=True,
        ports={"9999/tcp": ("127.0.0.1", taken)}, labels={"covey.test": "port-holder"})
    picked: list[int] = []

    def first_the_taken_one() -> int:
        picked.append(taken if not picked else free_port())
        return picked[-1]
    monkeypatch.setattr(stack, "free_port", first_the_taken_one)
    try:
        async with stack.ContainersStack(tmp_path).up():
            # Three published ports (the channel's proxy, the puppet, the plane), and the
            # first pick again.
            assert len(picked) == 4, f"the stack picked {picked}, the taken port {taken} first"
            refused = docker_client.containers.list(all=True, filters={
                "label": f"covey.owner_pid={os.getpid()}", "status": "created"})
            assert refused == [], f"the container Docker refused was left: {refused}"
    finally:
        holder.remove(force=True)
