"""Signing in (covey/sign_in.py): an unknown email costs what a known one does, failed attempts
are limited per account and per address with a 429 and Retry-After, a success resets the
account's count, and the session cookie is Secure over TLS."""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.testing import SCRIPTED_DAEMON
from covey.testing.plane import World, make_world, start_plane

PASSWORD = "correct horse battery"  # covey.testing.plane's humans


async def _world(database_url: str, tmp_path: Path, **settings: Any
                 ) -> AsyncIterator[World]:
    async with start_plane(database_url, tmp_path, SCRIPTED_DAEMON, **settings) as plane, \
            make_world(plane) as world:
        yield world


@pytest.fixture
async def limited(database_url: str, tmp_path: Path) -> AsyncIterator[World]:
    """Three free failures per account, ten per address, a first back-off of a minute (long
    enough that no test outruns it on a loaded machine)."""
    async for world in _world(database_url, tmp_path, login_failures_per_account=3,
                              login_failures_per_address=10, login_backoff_s=60):
        yield world


async def _login(world: World, email: str, password: str,
                 headers: dict[str, str] | None = None) -> httpx.Response:
    return await world.anonymous.post("/api/v1/auth/login", headers=headers,
                                      json={"email": email, "password": password})


async def test_an_unknown_email_takes_as_long_as_a_known_one(database_url: str,
                                                             tmp_path: Path) -> None:
    async for world in _world(database_url, tmp_path, login_failures_per_account=1000,
                              login_failures_per_address=1000):
        known: list[float] = []
        unknown: list[float] = []
        # Interleaved, so that the machine's load falls on both alike, and each first in
        # turn: the second of a pair came out slower whichever it was.
        for i in range(10):
            pair = [("auditor@acme.test", known), (f"nobody{i}@acme.test", unknown)]
            for email, times in pair if i % 2 else reversed(pair):
                started = time.perf_counter()
                r = await _login(world, email, "wrong password")
                times.append(time.perf_counter() - started)
                assert r.status_code == 401, r.text
                assert r.json()["error"] == "Wrong email or password"
        k, u = statistics.median(known), statistics.median(unknown)
        print(f"login medians: known {k * 1000:.1f} ms, unknown {u * 1000:.1f} ms")
        assert max(k, u) < 2 * min(k, u), (
            f"a known account's failed sign-in takes {k * 1000:.0f} ms (median), an unknown "
            f"one's {u * 1000:.0f} ms: the time tells which accounts exist")


async def test_failed_sign_ins_are_limited_per_account_known_or_not(limited: World) -> None:
    for email in ("auditor@acme.test", "nobody@acme.test"):
        for _ in range(3):
            assert (await _login(limited, email, "wrong")).status_code == 401
        # The right password too: a limit that let it through would be no limit.
        for password in ("wrong", PASSWORD):
            r = await _login(limited, email, password)
            assert r.status_code == 429, r.text
            assert r.json()["error"] == "Too many failed sign-ins", r.text
            assert 1 <= int(r.headers["retry-after"]) <= 60, r.headers
    # Another account from the same address is not held by these two.
    assert (await _login(limited, "security@acme.test", PASSWORD)).status_code == 200
    # Nor are the automation's tokens.
    assert (await limited.auditor.get("/api/v1/fleet")).status_code == 200


async def test_a_success_resets_the_account_s_count(limited: World) -> None:
    for _ in range(2):
        assert (await _login(limited, "auditor@acme.test", "wrong")).status_code == 401
    assert (await _login(limited, "auditor@acme.test", PASSWORD)).status_code == 200
    # Counting from zero again: three more failures are answered, the fourth attempt waits.
    for _ in range(3):
        assert (await _login(limited, "auditor@acme.test", "wrong")).status_code == 401
    assert (await _login(limited, "auditor@acme.test", PASSWORD)).status_code == 429


async def test_failed_sign_ins_are_limited_per_address(limited: World) -> None:
    # One guess at each of many accounts (a spray) meets the address's limit, not theirs.
    for i in range(10):
        r = await _login(limited, f"someone{i}@acme.test", "wrong")
        assert r.status_code == 401, (i, r.text)
    r = await _login(limited, "security@acme.test", PASSWORD)
    assert r.status_code == 429 and "retry-after" in r.headers, r.text


async def test_the_page_s_sign_in_form_shares_the_limit(limited: World) -> None:
    for _ in range(3):
        assert (await _login(limited, "security@acme.test", "wrong")).status_code == 401
    client = limited.anonymous
    page = await client.get("/administration")
    csrf = page.text.split('name="csrf" value="')[1].split('"')[0]
    r = await client.post("/administration/login", headers={"Accept": "application/json"},
                          data={"csrf": csrf, "email": "security@acme.test",
                                "password": PASSWORD})
    assert r.status_code == 429 and "retry-after" in r.headers, r.text


async def test_the_session_cookie_is_secure_over_tls(world: World) -> None:
    plain = await _login(world, "auditor@acme.test", PASSWORD)
    assert plain.status_code == 200 and "secure" not in plain.headers["set-cookie"].lower()
    # As a TLS-terminating proxy on this host tells uvicorn (it trusts 127.0.0.1).
    tls = await _login(world, "auditor@acme.test", PASSWORD,
                       headers={"X-Forwarded-Proto": "https"})
    assert tls.status_code == 200, tls.text
    cookie = tls.headers["set-cookie"].lower()
    assert "secure" in cookie and "httponly" in cookie and "samesite=strict" in cookie, cookie


async def test_the_session_cookie_is_secure_always_by_setting(database_url: str,
                                                              tmp_path: Path) -> None:
    async for world in _world(database_url, tmp_path, cookie_secure="always"):
        r = await _login(world, "auditor@acme.test", PASSWORD)
        assert r.status_code == 200 and "secure" in r.headers["set-cookie"].lower(), r.headers
