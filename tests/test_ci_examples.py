"""The CI examples (examples/ci/) work as written: each valid against its CI system's schema
(check-jsonschema's vendored copies, offline), their shell steps clean under shellcheck, and
what went wrong in them once cannot come back: an `apt-get install` before `apt-get update`,
Debian bootstrapped on Ubuntu without Debian's keyring, a browser game day that skips
silently, root-owned files left to GitLab's shell executor, the whole history carried
forward, a `gameday` command or option that does not exist."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from harness.run.cli import app

ROOT = Path(__file__).resolve().parent.parent
GITHUB = ROOT / "examples" / "ci" / "github-gameday.yml"
GITLAB = ROOT / "examples" / "ci" / "gitlab-ci.yml"
BIN = Path(sys.executable).parent
GATE_WINDOW = 10  # `gameday gate --window`'s default: the history kept must be longer


def load(path: Path) -> dict[Any, Any]:
    document: dict[Any, Any] = yaml.safe_load(path.read_text())
    return document


def github_steps() -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = load(GITHUB)["jobs"]["gameday"]["steps"]
    return steps


def gitlab_job() -> dict[str, Any]:
    job: dict[str, Any] = load(GITLAB)["gameday"]
    return job


def shell_steps() -> dict[str, str]:
    """Every shell step of both examples, as a script: name → text. GitHub's expressions
    (`${{ ... }}`) become a variable, as the runner substitutes them before the shell runs."""
    steps = {f"github step {i}": re.sub(r"\$\{\{[^}]*\}\}", "$GITHUB_EXPRESSION", step["run"])
             for i, step in enumerate(github_steps()) if "run" in step}
    job = gitlab_job()
    steps["gitlab script"] = "\n".join(job["script"])
    steps["gitlab after_script"] = "\n".join(job["after_script"])
    return steps


def called_scripts() -> dict[str, str]:
    """The repository's scripts the steps run, by path: they are part of what runs."""
    names = {m for text in shell_steps().values() for m in re.findall(r"scripts/[\w-]+", text)}
    missing = [n for n in names if not (ROOT / n).is_file()]
    assert not missing, f"the CI examples run scripts that do not exist: {missing}"
    return {n: (ROOT / n).read_text() for n in sorted(names)}


@pytest.mark.parametrize(("example", "schema"), [(GITHUB, "vendor.github-workflows"),
                                                 (GITLAB, "vendor.gitlab-ci")])
def test_each_example_is_valid_against_its_ci_system_s_schema(example: Path,
                                                               schema: str) -> None:
    checked = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                              schema, str(example)], capture_output=True, text=True,
                             timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_schema_check_catches_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text(GITHUB.read_text().replace("runs-on:", "runs_on:"))
    checked = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                              "vendor.github-workflows", str(broken)], capture_output=True,
                             text=True, timeout=120)
    assert checked.returncode == 1, checked.stdout + checked.stderr


def test_every_shell_step_and_script_it_runs_is_clean_under_shellcheck(
        tmp_path: Path) -> None:
    files = []
    for name, text in {**shell_steps(), **called_scripts()}.items():
        path = tmp_path / re.sub(r"\W", "_", name)
        path.write_text(text if text.startswith("#!") else f"#!/usr/bin/env bash\n{text}\n")
        files.append(str(path))
    checked = subprocess.run([str(BIN / "shellcheck"), "--shell=bash", "--severity=warning",
                              *files], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_apt_get_install_comes_after_an_apt_get_update() -> None:
    for name, text in {**shell_steps(), **called_scripts()}.items():
        # Commands, not what a message says or a comment tells.
        text = re.sub(r'"[^"\n]*"|#[^\n]*', "", text)
        update = text.find("apt-get update")
        for install in re.finditer(r"apt-get install", text):
            assert 0 <= update < install.start(), \
                f"{name}: apt-get install without apt-get update before it"


def test_debian_is_bootstrapped_with_debian_s_keyring() -> None:
    build = (ROOT / "scripts" / "build-image").read_text()
    assert "debian-archive-keyring" in build  # installed where missing (Ubuntu)
    assert re.search(r"debootstrap [^\n]*--keyring=", build), \
        "debootstrap is not told to check against Debian's keyring"


def test_the_browser_game_day_cannot_skip_silently() -> None:
    assert load(GITHUB)["env"]["COVEY_REQUIRE_BROWSER"] == "1"
    assert load(GITLAB)["variables"]["COVEY_REQUIRE_BROWSER"] == "1"
    # ... and each provides the browser at the paths the harness drives.
    github = "\n".join(shell_steps()[k] for k in shell_steps() if k.startswith("github"))
    assert "/usr/bin/chromium" in github and "/usr/bin/chromedriver" in github
    assert "scripts/browser" in shell_steps()["gitlab script"]


def test_gitlab_hands_back_what_root_wrote_whatever_happened() -> None:
    job = gitlab_job()
    if any(line.startswith("sudo ") for line in job["script"]):
        assert job["after_script"][0].startswith('sudo chown -R "$(id -u):$(id -g)"'), \
            "files written with sudo stay root's in the shell executor's build folder"


def test_only_the_newest_runs_are_carried_forward() -> None:
    steps = github_steps()
    prune = [i for i, s in enumerate(steps) if "gameday prune --keep" in s.get("run", "")]
    kept = [i for i, s in enumerate(steps) if str(s.get("uses", "")).startswith(
        ("actions/cache/save", "actions/upload-artifact"))]
    assert prune and kept and max(prune) < min(kept), "reports are kept before the prune"
    assert steps[prune[0]]["if"] == "always()"
    # GitLab saves its cache and artifacts after after_script.
    assert any("gameday prune --keep" in line for line in gitlab_job()["after_script"])
    for example in (load(GITHUB).get("env", {}), load(GITLAB).get("variables", {})):
        assert int(example["KEEP_RUNS"]) > GATE_WINDOW


def test_every_gameday_command_and_option_the_examples_use_exists() -> None:
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    variables = {**load(GITHUB)["env"], **load(GITLAB)["variables"]}
    used = 0
    for name, text in shell_steps().items():
        for line in text.splitlines():
            if ".venv/bin/gameday " not in line:
                continue
            words = shlex.split(line.partition(".venv/bin/gameday ")[2], comments=True)
            words = [re.sub(r"\$(\w+)", lambda m: str(variables[m.group(1)]), w)
                     for w in words]
            sub = commands.get(words[0])
            assert sub is not None, f"{name}: no `gameday {words[0]}`"
            try:
                sub.make_context(words[0], words[1:])  # parses as the command would
            except Exception as exc:
                pytest.fail(f"{name}: `gameday {' '.join(words)}`: {exc}")
            used += 1
    assert used >= 6
