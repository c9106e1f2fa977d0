"""The stack: brings the system under test up and down, the same interface for every backend
(DESIGN §3). `processes` runs the real parts as local processes on an embedded Postgres;
`target` starts nothing and points at an existing deployment; `containers` runs each part
in a container of the stack's image.

A stack hands the game day its `Endpoints`: where the control plane answers, credentials of
an org admin, and the puppet model the agents talk to. The room also holds what every part
of the harness shares to reach the system: one free port, one wait, the embedded Postgres,
the game day's organisation.
"""
