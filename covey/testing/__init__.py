"""An in-process covey for the tests and benchmarks of covey, as `starlette.testclient` is
for Starlette: a real control plane served by uvicorn on a loopback port over a real
database (`covey.testing.plane`), organisations with one human and API token per role, and
scripted sandbox daemons that speak the real protocol.

It needs none of the harness's libraries (a deployment imports every module of covey/), and
the harness does not use it: the harness reaches covey only from outside.

The daemons are started by path, not with `-m`, so that each sandbox starts without importing
the covey package (the benchmarks start hundreds of them).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent

# Speaks the protocol and does what its task body says (hold, deaf, work:SECS, crash, …).
SCRIPTED_DAEMON = [sys.executable, str(_HERE / "scripted_daemon.py")]
# coveyd with a broken kill handling: one more model request after its kill_ack.
ACTS_AFTER_ACK = [sys.executable, str(_HERE / "acts_after_ack.py")]
