"""Configuration from the environment, with the same names everywhere (DESIGN §2.6)."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Heartbeats once fired every second: fourteen of them filled a backlog with thousands of
# tasks in minutes. By default no heartbeat fires more often than once a minute.
HEARTBEAT_MIN_S = 60

# How long a stopping server waits for its open connections before it cancels them.
GRACEFUL_SHUTDOWN_S = 5


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the variable and a valid value."""


PLANE_NICE = -10


def _plane_nice(raw: str | None) -> int | None:
    """COVEY_PLANE_NICE: a nice value from -20 to 19, or `off`."""
    if raw is None or raw.strip() == "":
        return PLANE_NICE
    if raw.strip() == "off":
        return None
    try:
        nice = int(raw)
    except ValueError:
        nice = 99
    if not -20 <= nice <= 19:
        raise ConfigError(f"COVEY_PLANE_NICE={raw!r}: use a nice value from -20 to 19, or "
                          "'off' to leave the control plane's CPU priority as the host gives it")
    return nice


def _int_env(env: dict[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer (e.g. {name}={default})") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} is below {minimum}")
    return value


@dataclass(frozen=True)
class Settings:
    database_url: str | None
    data_dir: Path
    tick_ms: int = 1000
    lease_ms: int = 2000
    daemon_command: list[str] = field(default_factory=lambda: ["coveyd"])
    sandbox_backend: str = "process"
    public_ws_url: str | None = None
    model_url: str | None = None
    daemon_token_ttl_s: int = 60
    daemon_timeout_s: int = 15
    max_daemon_retries: int = 5
    max_body_bytes: int = 64 * 1024
    kill_grace_s: float = 5.0
    # The second line: a daemon that has not acknowledged its kill this long after it was
    # sent has its sandbox torn down by the runner (see kill_ack_bound_s). 0: no second line.
    kill_ack_bound_ms: int = 1000
    # Variables of the control plane's own environment that sandboxes get; nothing else of it
    # (a sandbox must not see DATABASE_URL). COVEY_SANDBOX_PASS_ENV adds names.
    sandbox_pass_env: tuple[str, ...] = ("COVEY_MODEL_API_KEY", "COVEY_MODEL_PRICES",
                                         "COVEY_MODEL_MAX_TOKENS_FIELD", "COVEY_MODEL_RETRIES",
                                         "COVEY_MODEL_BACKOFF_MS", "COVEY_LOG_LEVEL")
    sandbox_image: str = "covey-gameday:latest"
    docker_network: str = "host"
    gameday: str = ""
    warm_sync_s: int = 300
    warm_idle_s: int = 900
    # The shortest heartbeat period: no heartbeat fires more often (covey.orchestrator). Only
    # game days lower it, to see a heartbeat come due many times within a minute's stop.
    heartbeat_min_s: int = HEARTBEAT_MIN_S
    log_level: str = "INFO"
    # covey.admission: reads served at once, and waiting beyond them before a 429; the
    # connections of the switches' own pool, which reads never take.
    read_concurrency: int = 8
    read_queue: int = 32
    switch_connections: int = 4
    # "auto": the process sandboxes share one CPU cgroup where one can be made (covey/cpu_group.py).
    sandbox_cpu_group: str = "auto"
    # The CPU weight of each docker sandbox (cgroup cpu.shares; a container's default is 1024,
    # as is the control plane's and Postgres's when they run in containers): see DockerProvider.
    sandbox_cpu_shares: int = 128
    # The nice value `covey serve` gives its own autogroup (covey.cpu_group.raise_plane_priority);
    # None: left as the host gives it.
    plane_nice: int | None = PLANE_NICE
    # covey.sign_in: failed sign-ins allowed per account and per client address before each
    # further one waits (back-off doubling from login_backoff_s up to login_backoff_max_s);
    # argon2 verifications at once (the rest queue, then 429).
    login_failures_per_account: int = 5
    login_failures_per_address: int = 20
    login_backoff_s: int = 2
    login_backoff_max_s: int = 900
    login_hashing: int = 1
    # The session cookie's Secure attribute: "auto" when the request came over TLS (as uvicorn
    # sees it, X-Forwarded-Proto of a trusted proxy included), "always" behind a TLS proxy that
    # does not say so.
    cookie_secure: str = "auto"

    @property
    def sandbox_log_dir(self) -> Path:
        """Where each sandbox's daemon output is kept, one `<sandbox id>.log` per sandbox."""
        return self.data_dir / "logs"

    @property
    def kill_ack_bound_s(self) -> float | None:
        """How long a daemon has to acknowledge a kill before the runner tears its sandbox
        down; None when the second line is off. Never more than half the lease: the second
        line must come well before a deaf daemon would stop by itself."""
        if self.kill_ack_bound_ms <= 0:
            return None
        return min(self.kill_ack_bound_ms, self.lease_ms / 2) / 1000

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        backend = env.get("COVEY_SANDBOX_BACKEND", "process")
        if backend not in ("process", "docker"):
            raise ConfigError(f"COVEY_SANDBOX_BACKEND={backend!r}: use 'process' or 'docker'")
        raw = env.get("COVEY_DAEMON_COMMAND")
        if raw is None:
            # This interpreter's coveyd for local processes, the image's for containers.
            command = [sys.executable, "-m", "covey.coveyd"] if backend == "process" \
                else ["coveyd"]
        else:
            command = shlex.split(raw)
        if not command:
            raise ConfigError("COVEY_DAEMON_COMMAND is empty: give the daemon's command line")
        log_level = (env.get("COVEY_LOG_LEVEL") or "INFO").upper()
        if log_level not in LOG_LEVELS:
            raise ConfigError(f"COVEY_LOG_LEVEL={env['COVEY_LOG_LEVEL']!r}: use one of "
                              f"{', '.join(level.lower() for level in LOG_LEVELS)}")
        cpu_group = env.get("COVEY_SANDBOX_CPU_GROUP", "auto")
        if cpu_group not in ("auto", "off"):
            raise ConfigError(f"COVEY_SANDBOX_CPU_GROUP={cpu_group!r}: use 'auto' or 'off'")
        plane_nice = _plane_nice(env.get("COVEY_PLANE_NICE"))
        cookie_secure = env.get("COVEY_COOKIE_SECURE", "auto")
        if cookie_secure not in ("auto", "always"):
            raise ConfigError(f"COVEY_COOKIE_SECURE={cookie_secure!r}: use 'auto' or 'always'")
        return cls(
            database_url=env.get("DATABASE_URL") or None,
            data_dir=Path(env.get("COVEY_DATA_DIR", ".covey")).absolute(),
            tick_ms=_int_env(env, "COVEY_TICK_MS", 1000, 10),
            lease_ms=_int_env(env, "COVEY_LEASE_MS", 2000, 100),
            daemon_command=command,
            sandbox_backend=backend,
            public_ws_url=env.get("COVEY_PUBLIC_WS_URL") or None,
            model_url=env.get("COVEY_MODEL_URL") or None,
            daemon_token_ttl_s=_int_env(env, "COVEY_DAEMON_TOKEN_TTL_S", 60, 1),
            daemon_timeout_s=_int_env(env, "COVEY_DAEMON_TIMEOUT_S", 15, 1),
            max_daemon_retries=_int_env(env, "COVEY_MAX_DAEMON_RETRIES", 5, 0),
            kill_ack_bound_ms=_int_env(env, "COVEY_KILL_ACK_BOUND_MS", 1000, 0),
            sandbox_pass_env=(*cls.sandbox_pass_env, *(
                n.strip() for n in env.get("COVEY_SANDBOX_PASS_ENV", "").split(",") if n.strip())),
            sandbox_image=env.get("COVEY_SANDBOX_IMAGE") or "covey-gameday:latest",
            docker_network=env.get("COVEY_DOCKER_NETWORK") or "host",
            gameday=env.get("COVEY_GAMEDAY", ""),
            warm_sync_s=_int_env(env, "COVEY_WARM_SYNC_S", 300, 1),
            warm_idle_s=_int_env(env, "COVEY_WARM_IDLE_S", 900, 1),
            heartbeat_min_s=_int_env(env, "COVEY_HEARTBEAT_MIN_S", HEARTBEAT_MIN_S, 1),
            log_level=log_level,
            read_concurrency=_int_env(env, "COVEY_READ_CONCURRENCY", 8, 1),
            read_queue=_int_env(env, "COVEY_READ_QUEUE", 32, 0),
            switch_connections=_int_env(env, "COVEY_SWITCH_CONNECTIONS", 4, 1),
            sandbox_cpu_group=cpu_group,
            sandbox_cpu_shares=_int_env(env, "COVEY_SANDBOX_CPU_SHARES", 128, 2),
            plane_nice=plane_nice,
            login_failures_per_account=_int_env(env, "COVEY_LOGIN_FAILURES_PER_ACCOUNT", 5, 1),
            login_failures_per_address=_int_env(env, "COVEY_LOGIN_FAILURES_PER_ADDRESS", 20, 1),
            login_backoff_s=_int_env(env, "COVEY_LOGIN_BACKOFF_S", 2, 1),
            login_backoff_max_s=_int_env(env, "COVEY_LOGIN_BACKOFF_MAX_S", 900, 1),
            login_hashing=_int_env(env, "COVEY_LOGIN_HASHING", 1, 1),
            cookie_secure=cookie_secure,
        )


# Where coveyd asks when COVEY_MODEL_URL is not set (covey.coveyd.DEFAULT_MODEL_URL): a
# local Ollama's OpenAI-compatible API.
DAEMON_DEFAULT_MODEL_URL = "http://127.0.0.1:11434/v1"


def model_url_warning(settings: Settings) -> str | None:
    """What `covey serve` says at start when no model endpoint is configured: every session
    would otherwise fail on its first model call with nothing said where the operator looks."""
    if settings.model_url:
        return None
    return (f"COVEY_MODEL_URL is not set: each sandbox's coveyd will ask "
            f"{DAEMON_DEFAULT_MODEL_URL} (a local Ollama); when nothing answers there, "
            "every task is blocked with 'model endpoint ... unreachable'")
