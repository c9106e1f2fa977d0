"""`gameday run`: its help lists every option the pytest plugin takes, and a usage error is
one line, not a traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[2] / "harness" / "run" / "plugin.py"


def gameday(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness.run.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)


def test_gameday_run_help_lists_every_option_of_the_plugin() -> None:
    declared = re.findall(r'addoption\(\s*"(--[a-z-]+)"', PLUGIN.read_text())
    assert {"--target-url", "--reuse-stack", "--duration"} <= set(declared)
    shown = gameday("run", "--help", env={**os.environ, "COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    missing = [o for o in declared if o not in shown.stdout]
    assert not missing, f"gameday run --help does not list {missing}"


def test_stack_target_without_its_url_is_one_line_not_a_traceback() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVEY_TARGET_")}
    refused = gameday("run", "--stack", "target", "--target-email", "a@x.test", env=env)
    assert refused.returncode == 2
    out = (refused.stdout + refused.stderr).strip().splitlines()
    assert out == ["gameday run: --stack target needs --target-url, --target-password (or "
                   "COVEY_TARGET_* variables)"], out
