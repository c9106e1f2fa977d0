"""`covey serve | migrate | bootstrap` (DESIGN §2.6)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import asyncpg
import structlog

from covey.config import GRACEFUL_SHUTDOWN_S, ConfigError, Settings, model_url_warning

log = structlog.get_logger(__name__)


@contextmanager
def _database_url(settings: Settings) -> Iterator[str]:
    """The given DATABASE_URL, untouched; else the embedded Postgres, for this command's
    length (`covey serve` holds it in the app's lifespan instead)."""
    if settings.database_url:
        log.info("database from DATABASE_URL: covey neither starts nor stops it")
        yield settings.database_url
        return
    from covey.embedded_postgres import embedded_postgres

    with embedded_postgres(settings.data_dir) as postgres:
        yield postgres.url


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    # A service manager's SIGTERM (or a closed terminal's SIGHUP) unwinds like Ctrl-C
    # does, so that the embedded Postgres is released on the way out.
    raise SystemExit(128 + signum)


async def _bootstrap(url: str, args: argparse.Namespace) -> str:
    from covey.api.auth import create_org, insert_human
    from covey.db import migrate
    from covey.security import verify_password

    await migrate(url)
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            org_id = await conn.fetchval("SELECT id FROM organizations WHERE name=$1", args.org)
            if org_id is None:
                org_id, _ = await create_org(conn, args.org, args.admin_email,
                                             args.admin_password)
            else:
                row = await conn.fetchrow(
                    "SELECT org_id, password_hash FROM humans WHERE email=$1",
                    args.admin_email.lower())
                if row is None or row["org_id"] != org_id:
                    raise SystemExit(f"organisation {args.org!r} exists without admin "
                                     f"{args.admin_email}; pick another --org")
                if not verify_password(row["password_hash"], args.admin_password):
                    raise SystemExit("admin exists with another password; not changed")
            if args.platform_admin_email:
                exists = await conn.fetchval("SELECT 1 FROM humans WHERE email=$1",
                                             args.platform_admin_email.lower())
                if not exists:
                    await insert_human(conn, org_id, args.platform_admin_email,
                                       args.platform_admin_password or "", "platform_admin")
    finally:
        await conn.close()
    return str(org_id)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="covey", description="covey control plane")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the control plane")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    sub.add_parser("migrate", help="apply database migrations")
    boot = sub.add_parser("bootstrap", help="create an organisation and its admin (idempotent)")
    boot.add_argument("--org", required=True)
    boot.add_argument("--admin-email", required=True)
    boot.add_argument("--admin-password", required=True)
    boot.add_argument("--platform-admin-email")
    boot.add_argument("--platform-admin-password")
    args = parser.parse_args(argv)

    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        sys.exit(f"covey: {exc}")
    from covey.logs import configure

    configure(settings.log_level)

    if args.command == "serve":
        import uvicorn

        from covey.app import create_app
        from covey.cpu_group import raise_plane_priority

        raise_plane_priority(settings.plane_nice)
        warning = model_url_warning(settings)
        if warning:
            log.warning(warning)
        app = create_app(settings, host=args.host, port=args.port, freeze_heap=True)
        # log_config=None: uvicorn's loggers write through ours, which redact tokens.
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", log_config=None,
                    ws="websockets-sansio", ws_ping_interval=5, ws_ping_timeout=5,
                    # The daemon channel's frames are small JSON: compressing each one cost
                    # both ends CPU (and each connection a zlib state) for a few bytes, and
                    # a fleet kill sends a thousand of them at once.
                    ws_per_message_deflate=False,
                    # Longer than a client's idle gaps: fewer kept-alive connections closed
                    # just as the client reuses them.
                    timeout_keep_alive=30,
                    # A stop waits this long for open connections, then cancels them: a
                    # daemon channel whose peer vanished without a close held it open.
                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        return
    if args.command == "bootstrap" and args.platform_admin_email \
            and not args.platform_admin_password:
        sys.exit("covey: --platform-admin-password is required with --platform-admin-email")
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    try:
        with _database_url(settings) as url:
            if args.command == "migrate":
                from covey.db import migrate

                applied = asyncio.run(migrate(url))
                print(f"applied {len(applied)} migration(s)"
                      + (f": {', '.join(applied)}" if applied else ""))
            else:
                print(asyncio.run(_bootstrap(url, args)))
    except ConfigError as exc:
        sys.exit(f"covey: {exc}")
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)
