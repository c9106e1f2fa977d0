"""`gameday load`: its verdict on fabricated runs, and short real runs of Locust against the
processes stack (a passing one, and one whose bound no kill can meet)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.load.kills import acknowledged_at, late_requests
from harness.load.runner import LoadPlan, judge, locust_command, run_seconds

MS = 1_000_000
PLAN = LoadPlan(users=10, spawn_rate=5, run_time="20s", max_kill_p99_ms=500)


def kill(ack_ms: float = 10, exited_ms: float = 80, open_ms: float = 8,
         failure: str | None = None) -> dict[str, Any]:
    return {"agent_id": "a1", "invoked_ns": 0, "acknowledged_ns": int(ack_ms * MS),
            "daemon_exited_ns": int(exited_ms * MS), "task_open_ns": int(open_ms * MS),
            "exit_codes": [3], "failure": failure}


def stats(requests: int = 400, failures: int = 0) -> list[dict[str, str]]:
    row = {"Type": "GET", "Name": "/api/v1/agents", "Request Count": str(requests),
           "Failure Count": str(failures), "Requests/s": "20.0"}
    ledger = {**row, "Name": "puppet ledger", "Failure Count": "3"}
    killed = {**row, "Type": "KILL", "Name": "kill → acknowledged", "Failure Count": "0"}
    total = {**row, "Type": "", "Name": "Aggregated"}
    return [row, ledger, killed, total]


def test_a_run_whose_kills_held_passes_with_hdr_percentiles() -> None:
    result = judge(PLAN, [kill(exited_ms=ms) for ms in range(50, 150)], stats(), 0)
    assert result.passed, result.problems
    assert result.kills == 100
    exited = result.parts_us["kill → daemon exited"]
    assert exited["p50_us"] == pytest.approx(99_000, rel=1e-2)
    assert exited["max_us"] == 149_000
    # Only the control plane's requests count: not the puppet's ledger, not the KILL rows.
    assert (result.requests, result.request_failures, result.requests_per_s) == (400, 0, 20.0)


def test_a_kill_that_did_not_hold_fails_the_run_with_its_reason() -> None:
    acted = "agent billing-bot made 2 model request(s) after its kill was acknowledged"
    result = judge(PLAN, [kill(), kill(failure=acted)], stats(), 0)
    assert not result.passed
    assert any(acted in problem for problem in result.problems), result.problems
    # The failed kill's figures are not folded into the percentiles of the kills that held.
    assert result.parts_us["kill → daemon exited"]["count"] == 1


def test_a_slow_p99_fails_the_gate_and_says_by_how_much() -> None:
    result = judge(PLAN, [kill()] * 98 + [kill(exited_ms=900)] * 2, stats(), 0)
    assert result.problems == ["kill → daemon exited p99 900.0 ms is over the bound of "
                               "500 ms"] or "over the bound of 500 ms" in result.problems[0]
    assert not result.passed
    assert judge(LoadPlan(10, 5, "20s"), [kill(exited_ms=900)], stats(), 0).passed


def test_shed_reads_are_counted_apart_and_are_no_failure() -> None:
    """A 429 (too many reads at once) is the control plane keeping the switches quick: the
    run counts it apart and neither among the requests served nor as a failure."""
    shed = {"Type": "SHED", "Name": "/api/v1/agents", "Request Count": "37",
            "Failure Count": "0", "Requests/s": "3.0"}
    result = judge(PLAN, [kill()], [*stats(), shed], 0)
    assert (result.shed_requests, result.requests, result.requests_per_s) == (37, 400, 20.0)
    assert result.passed, result.problems


def test_forked_workers_meet_their_master_on_a_loopback_port_of_the_run_s_own() -> None:
    """Not Locust's fixed 5557 on every interface, where workers of two runs on one machine
    meet the wrong master."""
    files = {"csv_prefix": "/r/load", "html": "/r/load.html"}
    command = locust_command("http://127.0.0.1:1", LoadPlan(users=4, spawn_rate=4,
                                                            run_time="10s", processes=2),
                             files, master_port=40123)
    flags = dict(itertools.pairwise(command))
    assert (flags["--processes"], flags["--master-bind-host"], flags["--master-bind-port"],
            flags["--master-port"]) == ("2", "127.0.0.1", "40123", "40123")
    assert int(flags["--expect-workers-max-wait"]) > 0, "a master must not wait for ever"
    assert "--master-bind-port" not in locust_command(
        "http://127.0.0.1:1", LoadPlan(users=4, spawn_rate=4, run_time="10s"), files)


def test_no_kill_or_failed_requests_is_no_pass() -> None:
    assert "no kill was measured" in judge(PLAN, [], stats(), 0).problems[0]
    failing = judge(PLAN, [kill()], stats(failures=7), 0)
    assert failing.problems == ["7 of 400 requests to the control plane failed under load "
                                "(Locust's failures table says which)"]
    assert "Locust wrote no statistics" in judge(PLAN, [kill()], [], 0).problems[-1]


def session(acked_at: str | None, confirmed_at: str, by: str = "kill_ack") -> dict[str, Any]:
    return {"kill_acked_at": acked_at, "kill_confirmed_at": confirmed_at,
            "kill_confirmed_by": by}


T0 = "2026-12-01T18:00:00.100000+00:00"  # the daemon's own kill_ack
T1 = "2026-12-01T18:00:00.104000+00:00"  # the control plane read it
NS0 = 1_796_148_000_100_000_000  # T0 in ns


def test_the_killer_counts_a_request_from_its_send_stamp_against_the_daemons_own_ack() -> None:
    answer_ns = NS0 + 20 * MS  # the switch answered 20 ms after the daemon acked
    acked = acknowledged_at(answer_ns, [session(T0, T1)])
    assert acked == pytest.approx(NS0, abs=1000)  # ns from µs timestamps, through a float
    # Seen by a busy puppet after the answer, sent before the ack: no action after the kill.
    before = {"at_ns": answer_ns + 50 * MS, "sent_ns": NS0 - 1 * MS}
    # Sent after the daemon said it had stopped, though before the switch answered.
    after = {"at_ns": NS0 + 6 * MS, "sent_ns": NS0 + 5 * MS}
    assert late_requests([before, after], acked) == [
        {"made_ns": NS0 + 5 * MS, "sent_ns": NS0 + 5 * MS, "received_ns": NS0 + 6 * MS}]


def test_the_killer_fails_closed_without_a_stamp_or_a_kill_ack() -> None:
    answer_ns = NS0 + 20 * MS
    # No daemon ack time of its own: the control plane's reading of the kill_ack.
    assert acknowledged_at(answer_ns, [session(None, T1)]) == pytest.approx(NS0 + 4 * MS,
                                                                             abs=1000)
    # A hang-up is no acknowledgement by the daemon: the switch's answer counts.
    assert acknowledged_at(answer_ns, [session(None, T1, by="lease")]) == answer_ns
    # A request with no send stamp counts from when the puppet saw it.
    unstamped = {"at_ns": answer_ns + 1 * MS, "sent_ns": None}
    assert [r["made_ns"] for r in late_requests([unstamped], answer_ns)] == [answer_ns + MS]


@pytest.mark.parametrize(("text", "seconds"), [("20s", 20), ("2m", 120), ("1h30m", 5400),
                                               ("90", 90)])
def test_run_times_read_as_locust_reads_them(text: str, seconds: float) -> None:
    assert run_seconds(text) == seconds


def test_a_run_time_locust_would_refuse_is_refused() -> None:
    with pytest.raises(ValueError, match="say 20s"):
        run_seconds("two minutes")


def gameday_load(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str],
                                                        dict[str, Any]]:
    run = subprocess.run(
        [sys.executable, "-m", "harness.run.cli", "load", "--stack", "processes", "--users", "4",
         "--spawn-rate", "4", "--run-time", "15s", "--agents", "3",
         "--report-dir", str(tmp_path), *extra],
        capture_output=True, text=True, timeout=240)
    summaries = list(tmp_path.glob("load-*.json"))
    assert len(summaries) == 1, f"no summary written; the command said:\n{run.stdout}\n" \
                                f"{run.stderr[-3000:]}"
    return run, json.loads(summaries[0].read_text())


@pytest.mark.slow
def test_a_short_headless_load_run_passes_and_writes_its_reports(tmp_path: Path) -> None:
    run, summary = gameday_load(tmp_path)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-3000:]}"
    assert summary["passed"] and summary["kills"] >= 1 and not summary["failed_kills"]
    assert set(summary["parts_us"]) == {"kill → acknowledged", "kill → daemon acked",
                                        "kill → daemon exited", "kill → task open"}
    assert summary["requests"] > 0 and summary["request_failures"] == 0
    # The killer in a Locust process of its own: its statistics beside the operators'.
    for kind in ("csv", "html", "killers_csv", "killers_html"):
        assert Path(summary["files"][kind]).stat().st_size > 0, kind
    killers = Path(summary["files"]["killers_csv"]).read_text()
    operators = Path(summary["files"]["csv"]).read_text()
    assert "KILL" in killers and "KILL" not in operators
    html = Path(summary["files"]["killers_html"]).read_text()
    # The killers' Locust report shows the KILL request type (its data is JSON, arrows
    # escaped).
    assert '"KILL"' in html and "daemon exited" in html
    assert "every kill held" in run.stdout


@pytest.mark.slow
def test_a_bound_no_kill_can_meet_fails_the_run_with_the_reason(tmp_path: Path) -> None:
    run, summary = gameday_load(tmp_path, "--kill-bound-ms", "0.001")
    assert run.returncode == 1, f"{run.stdout}\n{run.stderr[-3000:]}"
    assert summary["failed_kills"], summary
    assert all("over the bound of 0 ms" in k["failure"] for k in summary["failed_kills"])
    assert "over the bound" in run.stdout


@pytest.mark.slow
def test_two_locust_workers_on_this_machine_start_users_and_measure_kills(
        tmp_path: Path) -> None:
    run, summary = gameday_load(tmp_path, "--processes", "2")
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-3000:]}"
    assert summary["requests"] > 0 and summary["kills"] >= 1, (
        f"two workers sent {summary['requests']} requests and measured {summary['kills']} "
        "kills: their users never started")
