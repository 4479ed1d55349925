"""Opaque continuations of filtered listings (DESCRIBE_STREAMS pages). No I/O.

The PM's continuation of a page is the id of the last stream it read, which the gate may have
filtered out of the answer (the caller may not describe it): handed back as is, it would tell
the caller that stream exists and, for a ``name_prefix`` listing, that its name starts with the
prefix. The gate seals it instead: a keyed permutation (a 4-round Feistel network over 62 bits,
HMAC-SHA-256 rounds, key derived from the cluster secret) of the position, marked by bit 62.
Every server holding the secret unseals it, so the next page may go to any PM; to whoever lacks
the key a sealed continuation is a pseudorandom number saying only "there is more". A forged one
unseals to some position: the listing resumes there, filtered as always.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final

SEALED_BIT: Final = 1 << 62
"""Marks a sealed continuation; stream ids (allocated from 1 upwards) never reach it."""
_HALF_BITS: Final = 31
_HALF_MASK: Final = (1 << _HALF_BITS) - 1
_ROUNDS: Final = 4
"""Four Feistel rounds with a pseudorandom round function make a strong pseudorandom
permutation (Luby-Rackoff)."""


def derive_cursor_key(secret: bytes) -> bytes:
    """The continuation key: separate from the token key."""
    return hmac.new(secret, b"sbpstream continuation key v1", hashlib.sha256).digest()


def _round(key: bytes, i: int, half: int) -> int:
    mac = hmac.new(key, bytes((i,)) + half.to_bytes(4, "big"), hashlib.sha256).digest()
    return int.from_bytes(mac[:4], "big") & _HALF_MASK


def seal(key: bytes, position: int) -> int:
    """The sealed form of ``position`` (a PM continuation, 0 <= position < 2**62); a negative
    position (no more) is returned as is."""
    if position < 0:
        return position
    if position >= SEALED_BIT:
        raise ValueError(f"continuation {position} is beyond what a listing can seal")
    left, right = position >> _HALF_BITS, position & _HALF_MASK
    for i in range(_ROUNDS):
        left, right = right, left ^ _round(key, i, right)
    return SEALED_BIT | (left << _HALF_BITS) | right


def unseal(key: bytes, value: int) -> int | None:
    """The position a sealed continuation stands for; None when ``value`` is not sealed."""
    if value < 0 or not value & SEALED_BIT or value >= SEALED_BIT << 1:
        return None
    v = value & (SEALED_BIT - 1)
    left, right = v >> _HALF_BITS, v & _HALF_MASK
    for i in reversed(range(_ROUNDS)):
        left, right = right ^ _round(key, i, left), left
    return (left << _HALF_BITS) | right
