"""Signing in with email and password: the same work whether the account exists or not, failed
attempts limited per account and per client address, and argon2 on a lane of its own.

Probed as an attacker would (issue 23): the API answered an unknown email in 8 ms and a known
one in 350 (anyone could list the accounts); 160 wrong passwords in a row were all answered
401 and the right one worked straight after; 16 concurrent sign-in loops slowed an agent kill
to 1.2 s, argon2's CPU taken from the event loop. So:

* an unknown email is verified against a hash of no one's password (`nobody_hash`) and its
  failure is counted as a known one's: neither the answer, nor its time, nor the limit tells
  whether the account exists;
* after `login_failures_per_account` failures for one email (known or not) or
  `login_failures_per_address` from one client address, each further attempt must wait a
  back-off doubling from `login_backoff_s` up to `login_backoff_max_s`. One made sooner is
  answered 429 with Retry-After before any hashing: one indexed read. A success clears its
  account's count, not its address's (a guesser with an account of their own would clear it
  between guesses at everyone else's); counts are forgotten an hour after their last failure;
* at most `login_hashing` argon2 verifications run at once, on threads of their own at a
  lower CPU priority (nice 10: argon2 releases the GIL and spreads over every core, and the
  event loop must win that contest), a few more wait, and beyond that a sign-in is answered
  429 at once. A refusal for a key the database already said is paused is remembered here
  until the pause ends, so that a flood of them costs no query. A flood of sign-ins costs
  sign-ins and not the switches, which are pulled with sessions and API tokens that exist
  already.

Both doors use this: POST /api/v1/auth/login and the /administration page's form.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from uuid import UUID

import asyncpg
from starlette.requests import Request
from starlette.responses import Response

from covey.config import Settings
from covey.db import Pool
from covey.errors import ApiError
from covey.security import new_token, nobody_hash, token_hash, verify_password

SESSION_COOKIE = "covey_session"
SESSION_HOURS = 12
FORGET_AFTER_S = 3600
WAITING_PER_HASHING = 8  # sign-ins that may wait for an argon2 turn, per turn
PURGE_EVERY = 100  # failures recorded between two purges of forgotten counts
PAUSES_REMEMBERED = 10_000
HASHING_NICE = 10

# Each of these keys that must still wait, and for how long (seconds): its failures beyond
# the free ones, each doubling the wait since its last failure. The exponent is capped so that
# a count grown over days never overflows a double.
_WAITS = """
SELECT key, wait_s FROM (
    SELECT f.key, extract(epoch FROM f.last_failed_at - now()
               + make_interval(secs => least($4::float8,
                                             $3::float8 * 2 ^ least(f.failures - k.free, 30))))
           AS wait_s
    FROM login_failures f JOIN unnest($1::text[], $2::int[]) AS k(key, free) ON k.key = f.key
    WHERE f.failures >= k.free AND f.last_failed_at > now() - make_interval(secs => $5)
) w WHERE wait_s > 0
"""
_FAILED = """
INSERT INTO login_failures AS f (key, failures, last_failed_at)
SELECT unnest($1::text[]), 1, now()
ON CONFLICT (key) DO UPDATE SET
    failures = CASE WHEN f.last_failed_at > now() - make_interval(secs => $2)
                    THEN f.failures + 1 ELSE 1 END,
    last_failed_at = now()
"""


def _key(kind: str, value: str) -> str:
    # Hashed: the table holds no one's email, nor the typos of strangers.
    return hashlib.sha256(f"{kind}:{value}".encode()).hexdigest()


def client_address(request: Request) -> str:
    """The caller's address as uvicorn sees it (a trusted proxy's X-Forwarded-For included)."""
    return request.client.host if request.client else "unknown"


def _too_many(wait_s: float) -> ApiError:
    retry = max(1, math.ceil(wait_s))
    return ApiError(429, "Too many failed sign-ins",
                    f"Sign-ins for this account or from this address are paused; retry in "
                    f"{retry} s. API tokens and existing sessions still work.",
                    headers={"Retry-After": str(retry)})


def _lower_priority() -> None:
    """An argon2 thread's start: below the event loop's priority (Linux: per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HASHING_NICE)


def _verify(password_hash: str | None, password: str) -> bool:
    return verify_password(password_hash if password_hash is not None else nobody_hash(),
                           password)


class SignIn:
    def __init__(self, pool: Pool, settings: Settings) -> None:
        self._pool = pool
        self._settings = settings
        self._hashing = ThreadPoolExecutor(settings.login_hashing, "argon2",
                                           initializer=_lower_priority)
        self._paused: OrderedDict[str, float] = OrderedDict()  # key -> until (loop time)
        self._in_line = 0
        self._failures = 0

    async def prepare(self) -> None:
        """Make the hash of no one's password now, off the loop: the first unknown email
        must not pay for it."""
        await asyncio.get_running_loop().run_in_executor(self._hashing, nobody_hash)

    def close(self) -> None:
        self._hashing.shutdown(wait=False, cancel_futures=True)

    async def verify(self, email: str, password: str, address: str) -> asyncpg.Record:
        """The account (id, org_id, email, role) these credentials open, or ApiError 401
        (wrong) or 429 (limited, or too many at once; with Retry-After)."""
        async with self._in_line_turn():
            email = email.lower()
            s = self._settings
            keys = [_key("account", email), _key("address", address)]
            loop = asyncio.get_running_loop()
            until = max(self._paused.get(k, 0.0) for k in keys)
            if until > loop.time():
                raise _too_many(until - loop.time())
            waits = await self._pool.fetch(
                _WAITS, keys, [s.login_failures_per_account, s.login_failures_per_address],
                s.login_backoff_s, s.login_backoff_max_s, FORGET_AFTER_S)
            if waits:
                for paused in waits:
                    self._remember_pause(paused["key"], loop.time() + float(paused["wait_s"]))
                raise _too_many(max(float(paused["wait_s"]) for paused in waits))
            row = await self._pool.fetchrow(
                "SELECT id, org_id, email, role, password_hash FROM humans WHERE email=$1",
                email)
            ok = await asyncio.get_running_loop().run_in_executor(
                self._hashing, _verify, row["password_hash"] if row is not None else None,
                password)
            if ok and row is not None:
                await self._pool.execute("DELETE FROM login_failures WHERE key=$1", keys[0])
                return row
            await self._pool.execute(_FAILED, keys, FORGET_AFTER_S)
            self._failures += 1
            if self._failures % PURGE_EVERY == 0:
                await self._pool.execute(
                    "DELETE FROM login_failures"
                    " WHERE last_failed_at < now() - make_interval(secs => $1)", FORGET_AFTER_S)
            raise ApiError(401, "Wrong email or password",
                           "Check both; passwords are case-sensitive.")

    def _remember_pause(self, key: str, until: float) -> None:
        self._paused[key] = until
        self._paused.move_to_end(key)
        while len(self._paused) > PAUSES_REMEMBERED:
            self._paused.popitem(last=False)

    @asynccontextmanager
    async def _in_line_turn(self) -> AsyncIterator[None]:
        if self._in_line >= self._settings.login_hashing * (1 + WAITING_PER_HASHING):
            raise ApiError(429, "Too many sign-ins at once",
                           "Retry in a second. API tokens and existing sessions still work.",
                           headers={"Retry-After": "1"})
        self._in_line += 1
        try:
            yield
        finally:
            self._in_line -= 1

    async def start_session(self, human_id: UUID) -> str:
        """A new web session for the human: its token, for the cookie."""
        token = new_token("cvs")
        await self._pool.execute(
            "INSERT INTO web_sessions (token_hash, human_id, expires_at)"
            " VALUES ($1, $2, now() + make_interval(hours => $3))",
            token_hash(token), human_id, SESSION_HOURS)
        return token

    def cookie_secure(self, request: Request) -> bool:
        return self._settings.cookie_secure == "always" or request.url.scheme == "https"

    def set_cookie(self, response: Response, request: Request, token: str) -> None:
        response.set_cookie(SESSION_COOKIE, token, httponly=True, samesite="strict",
                            max_age=SESSION_HOURS * 3600, secure=self.cookie_secure(request))

    def clear_cookie(self, response: Response, request: Request) -> None:
        response.delete_cookie(SESSION_COOKIE, httponly=True, samesite="strict",
                               secure=self.cookie_secure(request))
