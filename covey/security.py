"""Passwords, opaque tokens and their hashes. Tokens are stored only as SHA-256 hashes."""

from __future__ import annotations

import functools
import hashlib
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

_hasher = PasswordHasher()


def hash_password(password: str) -> str:
    return _hasher.hash(password)


def verify_password(password_hash: str, password: str) -> bool:
    try:
        return _hasher.verify(password_hash, password)
    except (VerificationError, InvalidHashError):
        return False


@functools.cache
def nobody_hash() -> str:
    """A hash of no one's password, made with the same parameters as every other: a sign-in
    for an unknown email verifies against it, so that it costs what a known one costs. (The
    API once answered unknown emails in 8 ms and known ones in 350: anyone could tell which
    accounts exist.) Made once per process, on first use: call it off the event loop."""
    return hash_password(secrets.token_urlsafe(16))


def new_token(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
