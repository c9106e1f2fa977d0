"""What pytest says of its game days: the summary at the end of the run, the JUnit
properties, and the index of runs updated when the session ends."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.report import runs
from harness.report.specimen import specimen_game_day
from tests.harness.builders import UNUSED_PLUGINS

pytest_plugins = ["pytester"]


def test_a_game_day_shows_in_the_summary_and_in_junit(pytester: pytest.Pytester,
                                                      tmp_path: Path) -> None:
    journal, history = specimen_game_day(4)
    journal["verdicts"][1] = {"checker": "in_progress_requeued", "valid": False,
                              "message": "task t1 was still in progress after the kill",
                              "evidence": [3]}
    path = tmp_path / "specimen.json"
    history.to_jsonl(path.with_suffix(".history.jsonl"))
    journal["history"] = path.with_suffix(".history.jsonl").name
    path.write_text(json.dumps(journal))
    pytester.makepyfile(test_recorded=f"""
        from pathlib import Path
        from harness.report.summary import record

        def test_recorded(request):
            record(request.node, [Path({str(path)!r})])
        """)
    xml = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess(f"--junitxml={xml}", "-p", "no:cacheprovider",
                                           *UNUSED_PLUGINS)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "*= covey game days =*",
        "specimen_fleet_stop_4 on processes: completed: 4 of 4 agents stopped · slowest * ms "
        "· 0 actions after the request · tasks of 4 agents back in the backlog · all done "
        "once after resume",
        "*daemon_exit*p50*ms*p99*ms*max*ms*(4 samples)",
        "*BROKE in_progress_requeued (failed): task t1 was still in progress after the kill",
        "*replay  pytest scenarios/fleet_stop.py::test_fleet_stop --stack processes --seed 7 "
        "--agents 4",
        f"*journal {path}",
    ])
    properties = {p.get("name"): p.get("value") for p in ET.parse(xml).iter("property")}
    assert properties["covey.status"] == "completed"
    assert properties["covey.agents"] == "4"
    assert properties["covey.verdicts_not_passed"] == "in_progress_requeued"
    assert float(properties["covey.daemon_exit.p99_ms"]) > 0
    assert [r.journal for r in runs.runs(tmp_path)] == ["specimen.json"]
