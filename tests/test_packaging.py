"""A deployment installs the control plane alone: `covey-gameday` without its `harness` extra
pulls in no test tooling, every module of covey/ imports without it, and the harness's
entry points say what to install instead of breaking."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import harness.run.entry

# What the harness brings and a control plane must never need (import names).
HARNESS_ONLY = ("pytest", "_pytest", "pytest_asyncio", "testcontainers", "faker", "hdrh",
                "locust", "typer", "rich", "plotly", "selenium", "schemathesis", "harness")


def test_the_control_plane_requires_none_of_the_harness_libraries() -> None:
    base = [r for r in metadata.requires("covey-gameday") or [] if "extra ==" not in r]
    names = {r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].strip().lower()
             for r in base}
    assert names, "covey-gameday lists no requirements at all"
    assert not names & {"pytest", "pytest-asyncio", "testcontainers", "faker", "locust",
                        "hdrhistogram", "typer", "rich", "plotly"}, sorted(names)


def test_every_covey_module_imports_without_the_harness() -> None:
    """Imports all of covey/ in a fresh interpreter that refuses the harness's libraries."""
    program = f"""
import importlib, importlib.abc, pkgutil, sys
refused = {HARNESS_ONLY!r}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in refused:
            raise ImportError(f"{{name}} belongs to the harness extra")
        return None
sys.meta_path.insert(0, Refuse())
import covey
names = [m.name for m in pkgutil.walk_packages(covey.__path__, "covey.")
         if not m.name.endswith(".__main__")]  # that one runs the command
for name in names:
    importlib.import_module(name)
print(len(names))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, f"a covey module needs the harness:\n{done.stderr[-3000:]}"
    assert int(done.stdout.split()[-1]) > 20, done.stdout


def test_gameday_without_the_extra_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real_version = metadata.version

    def version(name: str) -> str:
        if name in ("locust", "plotly"):
            raise metadata.PackageNotFoundError(name)
        return real_version(name)
    monkeypatch.setattr(harness.run.entry.metadata, "version", version)

    assert harness.run.entry.missing() == ["locust", "plotly"]
    with pytest.raises(SystemExit) as exit_:
        harness.run.entry.gameday()
    message = str(exit_.value.code)
    assert "locust, plotly are not installed" in message \
        and "pip install 'covey-gameday[harness]'" in message, message


def test_with_the_extra_pytest_gets_the_game_day_plugin() -> None:
    assert harness.run.entry.missing() == []
    assert harness.run.entry.pytest_plugins == ["harness.run.plugin"]


def test_the_harness_reaches_covey_only_from_outside() -> None:
    """No `import covey` in harness/: it talks to the control plane through HTTP, WebSocket,
    images and processes, so it tests a deployment exactly as it tests its own stacks."""
    harness_dir = Path(harness.run.entry.__file__).parents[1]
    imports = []
    for path in sorted(harness_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom)
                     and node.level == 0 else [])
            imports += [f"{path.relative_to(harness_dir.parent)}:{node.lineno} {n}"
                        for n in names if n.split(".")[0] == "covey"]
    assert len(list(harness_dir.rglob("*.py"))) > 20
    assert not imports, f"the harness imports the control plane: {imports}"


def test_the_wire_names_the_harness_spells_out_are_covey_s() -> None:
    from covey.coveyd import SENT_AT_HEADER
    from harness.act.puppet import SENT_AT_HEADER as PUPPET_READS

    assert PUPPET_READS == SENT_AT_HEADER, "the puppet reads another send-time header"
