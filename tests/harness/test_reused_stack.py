"""`--reuse-stack`: one stack for the whole run, and still every game day as if it were the
first: an organisation of its own, its own faults, everything rolled back."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _journals(report_dir: Path) -> list[dict[str, Any]]:
    documents = [json.loads(p.read_text()) for p in report_dir.glob("*.json")]
    return sorted(documents, key=lambda d: d["started_at"])


async def test_game_days_on_one_reused_stack_run_as_if_fresh(tmp_path: Path) -> None:
    # The fleet stop, the control-channel cut, and the fleet stop again, on one stack.
    again = tmp_path / "scenarios" / "fleet_stop_again.py"
    again.parent.mkdir()
    await asyncio.to_thread(shutil.copy, ROOT / "scenarios" / "fleet_stop.py", again)
    reports = tmp_path / "reports"
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"),
        "-p", "no:cacheprovider", str(ROOT / "scenarios" / "fleet_stop.py"),
        str(ROOT / "scenarios" / "control_channel_cut.py"), str(again),
        "--stack", "processes", "--reuse-stack", "--agents", "3", "--report-dir", str(reports),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(child.communicate(), 600)
    output = out.decode(errors="replace")
    assert child.returncode == 0, f"a game day on the reused stack failed:\n{output[-6000:]}"
    assert "one for the whole run" in output, "the header does not say the stack is reused"
    logs = list(reports.glob("control-plane-*.log"))
    assert len(logs) == 1, f"the stack came up {len(logs)} times, not once"
    journals = await asyncio.to_thread(_journals, reports)
    assert [j["status"] for j in journals] == ["completed"] * 3, journals
    assert len({j["isolation"]["id"] for j in journals}) == 3, "game days shared an organisation"
    assert all(j["isolation"]["own"] for j in journals)
    assert all(j["rollback"]["complete"] for j in journals), [j["rollback"] for j in journals]
    first, cut, last = journals
    assert cut["faults"], "the control-channel cut recorded no fault"
    # The cut's fault was that game day's alone: the next one judges none.
    assert first["faults"] == [] and last["faults"] == [], last["faults"]
    assert last["faults_healed"]["healed"] is True
