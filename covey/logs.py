"""Structured logs: one JSON object a line on stderr, for the control plane and its tools."""

from __future__ import annotations

import logging
import sys
import warnings

import structlog

# Libraries that tell their own start-up story at INFO (pgserver: every initdb and pg_ctl
# line with its full output); at INFO the log is the control plane's. COVEY_LOG_LEVEL=debug
# brings them back.
CHATTY_LIBRARIES = ("pgserver",)


def configure(level: str = "INFO") -> None:
    level = level.upper()
    logging.basicConfig(stream=sys.stderr, level=level, format="%(message)s")
    debug = level == "DEBUG"
    for name in CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(logging.DEBUG if debug else logging.WARNING)
    if not debug:
        # platformdirs (under pgserver) warns on every start where no login session set
        # XDG_RUNTIME_DIR (services, containers, CI) and falls back to a folder of its own.
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
