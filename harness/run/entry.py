"""Where pytest and the `gameday` command enter the harness.

`pip install covey-gameday` installs the control plane alone; the harness needs its extra
(`pip install 'covey-gameday[harness]'`). The distribution's pytest plugin entry point is
registered either way, so it comes here first: with the extra it brings in the game-day
plugin, without it it stays out of the way of every other pytest run on that machine, and
`gameday` says what to install instead of failing on an import.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

DISTRIBUTION = "covey-gameday"
INSTALL_HINT = "pip install 'covey-gameday[harness]'"


def missing() -> list[str]:
    """The harness extra's requirements that are not installed here (by distribution name)."""
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []  # run from a source tree: whatever imports fails, it fails by its name
    lacking = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        if not re.search(r"""extra\s*==\s*["']harness["']""", marker):
            continue
        name = re.match(r"[A-Za-z0-9._-]+", spec.strip())
        if name is None:
            continue
        try:
            metadata.version(name.group(0))
        except metadata.PackageNotFoundError:
            lacking.append(name.group(0))
    return lacking


# pytest registers this module for the entry point, then imports what it names here.
pytest_plugins = [] if missing() else ["harness.run.plugin"]


def gameday() -> None:
    """The `gameday` command."""
    lacking = missing()
    if lacking:
        sys.exit(f"gameday needs the harness, and {', '.join(lacking)} "
                 f"{'is' if len(lacking) == 1 else 'are'} not installed: {INSTALL_HINT}")
    from harness.run.cli import app

    app()
