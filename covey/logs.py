"""Structured logs: one JSON object a line on stderr, for the control plane and its tools."""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import structlog

# Libraries that tell their own start-up story at INFO (pgserver: every initdb and pg_ctl
# line with its full output); at INFO the log is the control plane's. COVEY_LOG_LEVEL=debug
# brings them back.
CHATTY_LIBRARIES = ("pgserver",)


def log_failure(logger: Any, event: str, **fields: Any
                ) -> Callable[[asyncio.Future[Any]], None]:
    """A done-callback that logs its task's exception as `event`, with `fields`: a task
    nobody awaits loses it otherwise (asyncio reports it only when the task is collected,
    if ever). A cancelled task is not a failure."""
    def logged(task: asyncio.Future[Any]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error(event, **fields, error=repr(exc))
    return logged


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
            redact_event,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    redact_stdlib_logs()


# Secrets that reach log lines by way of a request: the trigger token is part of its URL,
# API and daemon tokens ride in Authorization headers, and every token this server mints has
# a cv*_ prefix (covey.security.new_token). A failed trigger call once logged its token whole.
_SECRETS = (
    (re.compile(r"(/api/trigger/)[^\s/?#\"']+"), r"\1[redacted]"),
    (re.compile(r"(?i)(bearer\s+)[^\s\"',]+"), r"\1[redacted]"),
    (re.compile(r"\b(cv[a-z]{0,3}_)[A-Za-z0-9_-]{8,}"), r"\1[redacted]"),
)


def redact(text: str) -> str:
    """The line with every token this server knows how to recognise replaced."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(v) for v in value]
    return value


def redact_event(_logger: Any, _method: str, event_dict: Any) -> Any:
    """structlog processor: every value of the event, the formatted traceback included."""
    return {key: _redacted(value) for key, value in event_dict.items()}


class RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def redact_stdlib_logs() -> None:
    """Redact what goes through the standard library's logging too: uvicorn's access and
    error logs, and any library's. `covey serve` hands uvicorn's loggers to these root
    handlers (log_config=None) so that none writes past them."""
    for handler in logging.getLogger().handlers:
        formatter = handler.formatter or logging.Formatter("%(message)s")
        handler.setFormatter(RedactingFormatter(formatter._fmt, formatter.datefmt))
