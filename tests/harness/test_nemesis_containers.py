"""The nemesis's container faults, on a real Docker engine: pause, stop and disconnect do what
they say to a throwaway container and heal on their deadline and on demand, kill is instant,
a new fault replaces the standing one, and the end-of-day check names what has not healed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from docker import DockerClient
from docker.errors import NotFound
from docker.models.containers import Container
from docker.models.networks import Network

from harness.nemesis import BadFault, FaultRecord, HealFailed, Nemesis
from harness.stack.waiting import eventually

pytestmark = pytest.mark.docker

IMAGE = os.environ.get("COVEY_SANDBOX_IMAGE", "covey-gameday:latest")
LABELS = {"covey.test": "nemesis"}
ROOT = Path(__file__).resolve().parents[2]  # where `harness` imports from in a child process
ALIAS = "flag-store"
# Generous on purpose: a 2-core machine shared with other test runs.
HEAL_S = 20.0  # how long a heal due now may take to be seen
LONG_S = 60.0  # a deadline no test waits for

StartSleeper = Callable[[], Container]


def _name() -> str:
    return f"covey-test-nemesis-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def start_sleeper(docker_client: DockerClient) -> Iterator[StartSleeper]:
    """Start throwaway containers running `sleep 300`; all are removed after the test."""
    started: list[Container] = []

    def start() -> Container:
        container = docker_client.containers.run(IMAGE, ["sleep", "300"], name=_name(),
                                                 labels=LABELS, detach=True)
        started.append(container)
        return container

    yield start
    for container in started:
        with contextlib.suppress(NotFound):
            container.remove(force=True)


@pytest.fixture
def sleeper(start_sleeper: StartSleeper) -> Container:
    return start_sleeper()


@pytest.fixture
def network(docker_client: DockerClient) -> Iterator[Network]:
    """A throwaway network, removed after the test: whatever is still on it (a container of
    a fixture torn down later) is disconnected first."""
    net = docker_client.networks.create(_name(), labels=LABELS)
    yield net
    with contextlib.suppress(NotFound):
        net.reload()
        for container in net.containers:
            with contextlib.suppress(NotFound):
                net.disconnect(container, force=True)
        net.remove()


@pytest.fixture
def networked(network: Network, sleeper: Container) -> Container:
    """The sleeper, also on the throwaway network, known there by an alias."""
    network.connect(sleeper, aliases=[ALIAS])
    return sleeper


async def status(container: Container) -> str:
    def inspect() -> str:
        container.reload()
        return container.status
    return await asyncio.to_thread(inspect)


async def endpoint(container: Container, network: Network) -> dict[str, Any] | None:
    """The container's settings on the network; None when it is not on it."""
    def inspect() -> dict[str, Any] | None:
        container.reload()
        networks = container.attrs["NetworkSettings"]["Networks"] or {}
        settings = networks.get(network.name)
        return None if settings is None else dict(settings)
    return await asyncio.to_thread(inspect)


def record_of(nemesis: Nemesis, fault_id: str) -> FaultRecord:
    [record] = [r for r in nemesis.faults() if r.id == fault_id]
    return record


async def healed_by_deadline(nemesis: Nemesis, fault: FaultRecord) -> FaultRecord:
    """Wait for `fault` to heal on its own; returns its record."""
    async def healed() -> FaultRecord | None:
        record = record_of(nemesis, fault.id)
        return record if record.healed else None
    record = await eventually(healed, (fault.deadline_s or 0) + HEAL_S,
                              f"{fault.id} never healed")
    assert record.healed_by == "deadline", record
    assert record.deadline_s is not None and record.healed_ns is not None
    # The timer runs on the monotonic clock, the log on the wall clock: allow a little slack.
    assert record.healed_ns - record.started_ns >= record.deadline_s * 1e9 - 5e6, record
    assert record.note is None, record
    return record


# ------------------------------------------------------------ each fault, healed on its deadline


async def test_pause_container_pauses_it_until_its_deadline(
        docker_client: DockerClient, sleeper: Container) -> None:
    async with Nemesis(docker_client=docker_client) as nemesis:
        pause = await nemesis.pause_container(sleeper.name or "", deadline_s=1.5)
        assert pause.kind == "pause" and pause.target == f"container {sleeper.name}"
        assert not pause.healed and pause.heals_at_ns == pause.started_ns + 1_500_000_000
        assert await status(sleeper) == "paused"

        await healed_by_deadline(nemesis, pause)
        assert await status(sleeper) == "running"
        assert [f["healed_by"] for f in nemesis.fault_log()] == ["deadline"]


async def test_stop_container_stops_it_until_its_deadline(
        docker_client: DockerClient, sleeper: Container) -> None:
    async with Nemesis(docker_client=docker_client) as nemesis:
        # `sleep` as PID 1 ignores SIGTERM: no grace period, or the stop waits it out.
        stop = await nemesis.stop_container(sleeper.name or "", deadline_s=2.0, timeout_s=0)
        assert stop.kind == "stop" and stop.target == f"container {sleeper.name}"
        assert await status(sleeper) == "exited"

        await healed_by_deadline(nemesis, stop)
        assert await status(sleeper) == "running"


async def test_disconnect_container_takes_it_off_the_network_until_its_deadline(
        docker_client: DockerClient, networked: Container, network: Network) -> None:
    async with Nemesis(docker_client=docker_client) as nemesis:
        cut = await nemesis.disconnect_container(networked.name or "", network.name or "",
                                                 deadline_s=1.5)
        assert cut.kind == "disconnect" and cut.target == f"container {networked.name}"
        assert cut.network == network.name
        assert await endpoint(networked, network) is None
        assert await status(networked) == "running"

        await healed_by_deadline(nemesis, cut)
        back = await endpoint(networked, network)
        assert back is not None and ALIAS in back["Aliases"], back


async def test_disconnect_needs_a_network_the_container_is_on(
        docker_client: DockerClient, sleeper: Container, network: Network) -> None:
    async with Nemesis(docker_client=docker_client) as nemesis:
        with pytest.raises(BadFault, match="not connected"):
            await nemesis.disconnect_container(sleeper.name or "", network.name or "", 1.0)
        with pytest.raises(BadFault, match="deadline_s"):
            await nemesis.pause_container(sleeper.name or "", deadline_s=0)
        with pytest.raises(BadFault, match="timeout_s"):
            await nemesis.stop_container(sleeper.name or "", deadline_s=1.0, timeout_s=-1)
        with pytest.raises(NotFound):
            await nemesis.pause_container(_name(), deadline_s=1.0)
        assert nemesis.faults() == []
    assert await status(sleeper) == "running"


# ------------------------------------------------------------ healed on demand, replaced, killed


@pytest.mark.parametrize("kind", ["pause", "stop", "disconnect"])
async def test_resume_container_heals_each_fault_at_once(
        docker_client: DockerClient, networked: Container, network: Network,
        kind: str) -> None:
    assert networked.id is not None and networked.name is not None
    async with Nemesis(docker_client=docker_client) as nemesis:
        # Faulted by id, healed by name: the same container.
        if kind == "pause":
            fault = await nemesis.pause_container(networked.id, LONG_S)
            assert await status(networked) == "paused"
        elif kind == "stop":
            fault = await nemesis.stop_container(networked.id, LONG_S, timeout_s=0)
            assert await status(networked) == "exited"
        else:
            fault = await nemesis.disconnect_container(networked.id, network.id or "", LONG_S)
            assert await endpoint(networked, network) is None
        assert not nemesis.verify_healed().healed

        healed = await nemesis.resume_container(networked.name)
        assert healed is not None and healed.id == fault.id
        assert healed.healed_by == "heal" and healed.note is None
        assert await status(networked) == "running"
        back = await endpoint(networked, network)
        assert back is not None and ALIAS in back["Aliases"], back
        assert await nemesis.resume_container(networked.name) is None
        assert nemesis.verify_healed().healed


async def test_a_new_container_fault_replaces_the_standing_one(
        docker_client: DockerClient, networked: Container, network: Network) -> None:
    name = networked.name or ""
    async with Nemesis(docker_client=docker_client) as nemesis:
        pause = await nemesis.pause_container(name, LONG_S)
        stop = await nemesis.stop_container(name, LONG_S, timeout_s=0)
        assert await status(networked) == "exited"
        cut = await nemesis.disconnect_container(name, network.name or "", LONG_S)
        assert await status(networked) == "running"  # the stop was lifted first
        assert await endpoint(networked, network) is None

        assert [(r.id, r.healed_by) for r in nemesis.verify_healed().unhealed] == [
            (cut.id, None)]
        assert await nemesis.resume_container(name) is not None
        assert [(f["id"], f["healed_by"]) for f in nemesis.fault_log()] == [
            (pause.id, "replaced"), (stop.id, "replaced"), (cut.id, "heal")]
        back = await endpoint(networked, network)
        assert back is not None and ALIAS in back["Aliases"], back


async def test_kill_container_is_instant_and_ends_its_pause(
        docker_client: DockerClient, sleeper: Container) -> None:
    async with Nemesis(docker_client=docker_client) as nemesis:
        pause = await nemesis.pause_container(sleeper.name or "", LONG_S)
        kill = await nemesis.kill_container(sleeper.name or "")
        assert kill.kind == "kill" and kill.target == f"container {sleeper.name}"
        assert kill.healed_by == "instant" and kill.healed_ns == kill.started_ns
        assert await status(sleeper) == "exited"
        log = {f["id"]: f for f in nemesis.fault_log()}
        assert log[pause.id]["healed_by"] == "replaced"
        assert nemesis.verify_healed().healed
        assert await nemesis.resume_container(sleeper.name or "") is None


async def test_kill_container_puts_a_disconnected_one_back_on_its_network(
        docker_client: DockerClient, networked: Container, network: Network) -> None:
    async with Nemesis(docker_client=docker_client) as nemesis:
        cut = await nemesis.disconnect_container(networked.name or "", network.name or "",
                                                 LONG_S)
        await nemesis.kill_container(networked.name or "")
        assert await status(networked) == "exited"
        back = await endpoint(networked, network)
        assert back is not None and ALIAS in back["Aliases"], back
        assert record_of(nemesis, cut.id).healed_by == "replaced"
        assert nemesis.verify_healed().healed


# ---------------------------------------------------------------- the end of a game day


async def test_verify_healed_names_a_container_fault_until_it_heals(sleeper: Container) -> None:
    async with Nemesis() as nemesis:  # its own client, from the environment
        pause = await nemesis.pause_container(sleeper.name or "", deadline_s=2.0)
        report = nemesis.verify_healed()
        assert not report.healed
        assert [r.id for r in report.unhealed] == [pause.id]
        assert pause.id in report.message
        assert report.to_json()["unhealed"] == [pause.id]

        await healed_by_deadline(nemesis, pause)
        report = nemesis.verify_healed()
        assert report.healed, report.message
        assert await status(sleeper) == "running"


async def test_leaving_the_nemesis_heals_every_container_fault_still_standing(
        docker_client: DockerClient, network: Network, start_sleeper: StartSleeper) -> None:
    paused, stopped, cut = start_sleeper(), start_sleeper(), start_sleeper()
    network.connect(cut, aliases=[ALIAS])
    async with Nemesis(docker_client=docker_client) as nemesis:
        await nemesis.pause_container(paused.name or "", LONG_S)
        await nemesis.stop_container(stopped.name or "", LONG_S, timeout_s=0)
        await nemesis.disconnect_container(cut.name or "", network.name or "", LONG_S)
        assert len(nemesis.verify_healed().unhealed) == 3
    report = nemesis.verify_healed()
    assert report.healed, report.message
    assert [f.healed_by for f in report.faults] == ["heal", "heal", "heal"]
    for container in (paused, stopped, cut):
        assert await status(container) == "running"
    back = await endpoint(cut, network)
    assert back is not None and ALIAS in back["Aliases"], back


async def test_a_container_heal_that_fails_leaves_the_fault_standing_and_says_why(
        docker_client: DockerClient, sleeper: Container) -> None:
    name = sleeper.name or ""
    async with Nemesis(docker_client=docker_client) as nemesis:
        pause = await nemesis.pause_container(name, deadline_s=1.0)
        await asyncio.to_thread(sleeper.remove, force=True)  # gone before its deadline

        async def tried() -> str | None:
            return record_of(nemesis, pause.id).note
        note = await eventually(tried, HEAL_S, f"{pause.id} never tried to heal")
        assert "could not unpause" in note
        report = nemesis.verify_healed()
        assert not report.healed and [r.id for r in report.unhealed] == [pause.id]
        assert "could not unpause" in report.message

        with pytest.raises(HealFailed, match="could not unpause"):
            await nemesis.resume_container(name)
    # Leaving tried once more, quietly; the record still says it never healed.
    report = nemesis.verify_healed()
    assert not report.healed and [r.id for r in report.unhealed] == [pause.id]


async def test_a_container_pause_outlives_a_dead_harness_only_until_its_deadline(
        sleeper: Container, tmp_path: Path) -> None:
    # A harness that pauses the container and dies at once: its watchdog heals it.
    script = ("import asyncio, os, sys\n"
              "from harness.nemesis import Nemesis\n"
              "async def main():\n"
              "    await Nemesis().pause_container(sys.argv[1], float(sys.argv[2]))\n"
              "    os._exit(0)\n"
              "asyncio.run(main())\n")
    harness = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, sleeper.name or "", "3",
        cwd=ROOT,
        env={**os.environ, "COVEY_GAMEDAY_STATE": str(tmp_path)})
    assert await asyncio.wait_for(harness.wait(), 60) == 0
    assert await status(sleeper) == "paused", "the pause did not hold once the harness died"

    async def running() -> bool:
        return await status(sleeper) == "running"
    await eventually(running, 20, "the dead harness's container pause outlived its deadline")
