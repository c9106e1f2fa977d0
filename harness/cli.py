"""The `gameday` command line.

    gameday load --users 50 --spawn-rate 10 --run-time 2m --agents 20 [--stack processes]
"""

from __future__ import annotations

import asyncio
import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from harness.load.runner import LoadPlan, LoadResult, load_environment, prepare_fleet, run_load
from harness.load.runner import run_seconds as _run_seconds
from harness.stack import ContainersStack, ProcessesStack, Stack, TargetStack

app = typer.Typer(help="Game days for the kill switches of a covey agent fleet.",
                  no_args_is_help=True, add_completion=False)
console = Console()


class StackName(StrEnum):
    containers = "containers"
    processes = "processes"
    target = "target"


@app.callback()
def main() -> None:
    """Game days for the kill switches of a covey agent fleet: `gameday COMMAND --help`."""


def make_stack(stack: StackName, report_dir: Path, target_url: str | None,
               target_email: str | None, target_password: str | None,
               puppet_port: int | None) -> Stack:
    if stack is StackName.processes:
        return ProcessesStack(report_dir)
    if stack is StackName.containers:
        return ContainersStack(report_dir, image=os.environ.get("COVEY_SANDBOX_IMAGE",
                                                                "covey-gameday:latest"))
    if not (target_url and target_email and target_password):
        raise typer.BadParameter("--stack target needs --target-url, --target-email and "
                                 "--target-password (or COVEY_TARGET_* variables)",
                                 param_hint="--stack")
    return TargetStack(target_url, target_email, target_password, puppet_port)


@app.command()
def load(
    users: Annotated[int, typer.Option(help="operators reading and writing, beside the "
                                            "killers")] = 10,
    spawn_rate: Annotated[float, typer.Option(help="users started per second")] = 5.0,
    run_time: Annotated[str, typer.Option(help="how long the load runs: 20s, 2m, 1h")] = "1m",
    agents: Annotated[int, typer.Option(help="working agents the load runs against")] = 10,
    killers: Annotated[int, typer.Option(help="on-call engineers pulling agent switches, "
                                              "each a kill every 1-2 s")] = 1,
    stack: Annotated[StackName, typer.Option(help="where the control plane runs")]
        = StackName.processes,
    processes: Annotated[int, typer.Option(help="Locust worker processes on this machine "
                                                "(Locust's --processes)")] = 1,
    master: Annotated[int, typer.Option(help="run Locust as a master that waits for this "
                                             "many `locust --worker`s (from other machines)",
                                        metavar="WORKERS")] = 0,
    kill_bound_ms: Annotated[float, typer.Option(help="a kill whose daemon exits later than "
                                                      "this failed")] = 5000.0,
    max_kill_p99_ms: Annotated[float | None, typer.Option(
        help="fail when kill → daemon exited p99 is over this")] = None,
    report_dir: Annotated[Path, typer.Option(help="where the reports go")] = Path("reports"),
    target_url: Annotated[str | None, typer.Option(envvar="COVEY_TARGET_URL")] = None,
    target_email: Annotated[str | None, typer.Option(envvar="COVEY_TARGET_EMAIL")] = None,
    target_password: Annotated[str | None, typer.Option(envvar="COVEY_TARGET_PASSWORD")]
        = None,
    puppet_port: Annotated[int | None, typer.Option(help="with --stack target: serve the "
                                                         "puppet model on this port")] = None,
) -> None:
    """Locust load on the control plane while killers pull agent switches: kill →
    acknowledged, → daemon exited and → task open as request type KILL. Exits 1 when a kill
    failed (the agent acted after the acknowledgement, its daemon did not exit 3, or it took
    longer than --kill-bound-ms), when a request failed, or when the p99 is over the gate."""
    if min(users, agents, killers, processes) < 0 or agents < 1 or killers < 1:
        raise typer.BadParameter("--agents and --killers must be at least 1, --users and "
                                 "--processes at least 0")
    try:
        _run_seconds(run_time)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--run-time") from None
    plan = LoadPlan(users=users, spawn_rate=spawn_rate, run_time=run_time,
                    processes=processes, killers=killers, kill_bound_ms=kill_bound_ms,
                    max_kill_p99_ms=max_kill_p99_ms, master_workers=master)
    chosen = make_stack(stack, report_dir, target_url, target_email, target_password,
                        puppet_port)
    result = asyncio.run(_load(chosen, plan, agents, report_dir))
    show(result)
    raise typer.Exit(0 if result.passed else 1)


async def _load(stack: Stack, plan: LoadPlan, agents: int, report_dir: Path) -> LoadResult:
    with console.status(f"bringing the {stack.name} stack up") as status:
        async with stack.up() as endpoints:
            status.update(f"{agents} agents getting to work")
            fleet = await prepare_fleet(endpoints, agents)
            if plan.master_workers:
                worker_env = report_dir / "load-worker.env"
                worker_env.write_text("".join(f"{k}={v}\n" for k, v in
                                              load_environment(fleet, plan).items()))
                worker_env.chmod(0o600)
                console.print(f"waiting for {plan.master_workers} worker(s): on each, with "
                              f"the variables of {worker_env}, run `locust -f "
                              "harness/load/locustfile.py --worker --master-host THIS_HOST`")
            status.update(f"Locust: {plan.users} users and {plan.killers} killer(s) for "
                          f"{plan.run_time}")
            result = await run_load(endpoints, fleet, plan, report_dir)
            status.update(f"tearing the {stack.name} stack down")
    return result


def show(result: LoadResult) -> None:
    table = Table(title=f"kill under load: {result.plan.users} users, {result.kills} kills, "
                        f"{result.requests_per_s} requests/s")
    for column in ("part", "count", "p50 ms", "p90 ms", "p99 ms", "max ms"):
        table.add_column(column, justify="left" if column == "part" else "right")
    for part, p in result.parts_us.items():
        table.add_row(part, str(p["count"]), *(f"{p[k] / 1000:.1f}" for k in
                                                ("p50_us", "p90_us", "p99_us", "max_us")))
    console.print(table)
    for name, path in result.files.items():
        console.print(f"{name}: {path}")
    if result.passed:
        console.print("[green]every kill held[/green]")
    for problem in result.problems:
        console.print(f"[red]{problem}[/red]")


if __name__ == "__main__":
    app()
