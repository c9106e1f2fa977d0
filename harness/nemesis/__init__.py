"""The nemesis: faults with a deadline after which each heals itself, so a dead harness leaves
nothing broken, and a check at the end of a game day that every fault did heal.

* `standing`: the one standing-fault mechanism (replace the standing fault, heal on its
  deadline, log) that every kind of fault plugs into;
* `proxy`: the TCP fault proxy (latency, blackhole, reset, down) with its control API;
  `python -m harness.nemesis` runs one on its own;
* `processes`, `containers`: SIGSTOP/SIGKILL of processes, docker pause/stop/disconnect/kill;
* `database`: Postgres paused or restarted (the embedded server, or its container);
* `watchdog`: heal orders as plain data, carried out by a detached watchdog at a fault's
  deadline when the harness cannot, and the on-disk list of standing faults;
* `halt`: the harness's own stop switch (`gameday halt`);
* `core`: `Nemesis`, all faults of one game day.

Times in the log are wall-clock nanoseconds (`clock`, time.time_ns unless the game day's
History clock is passed); deadlines run on the monotonic clock.
"""

from harness.nemesis.core import Nemesis
from harness.nemesis.faults import (
                                    MAX_DEADLINE_S,
                                    MAX_LATENCY_MS,
                                    PROXY_FAULT_KINDS,
                                    BadFault,
                                    FaultKind,
                                    FaultRecord,
                                    HealedBy,
                                    HealFailed,
                                    HealReport,
                                    ProxyFaultKind,
                                    check_deadline,
)
from harness.nemesis.proxy import FaultProxy, RemoteFaultProxy, control_app, main

__all__ = ["MAX_DEADLINE_S", "MAX_LATENCY_MS", "PROXY_FAULT_KINDS", "BadFault", "FaultKind",
           "FaultProxy", "FaultRecord", "HealFailed", "HealReport", "HealedBy", "Nemesis",
           "ProxyFaultKind", "RemoteFaultProxy", "check_deadline", "control_app", "main"]
