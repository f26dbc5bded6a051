"""Who may talk to a worker: every message sealed with a key only the token's holders have.

The token is a shared secret (`--token-file` or `$SOMATIZE_TOKEN`, never needed on a command
line). The key is scrypt(token, salt) under a salt each worker process draws when it starts,
so one captured message does not let a typed token be guessed at the speed of a hash, and
what was captured before a restart is worthless. A client asks for the salt (`SALT_ASK`,
unsealed, answered with the salt and the worker's clock) before its first message.

A sealed message is `[seal, header, data_1, ...]`, `seal` being `MAGIC`, a random nonce, the
sender's clock and a Poly1305 tag (under a one-time key: BLAKE2b of the nonce and clock, keyed
with the session key) over all of these, the number of frames, every frame's length and every
byte, each part zero-padded to Poly1305's 16-byte block as RFC 8439 pads (every length is in
the tag, so the padding is unambiguous; a frame read from a block's start is MAC'd twice as
fast as one read after a partial block). What does not verify is `Refused` before a byte of
it is read; so is a message sealed more than `WINDOW` seconds from now, or one whose nonce
was seen (a replay).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct
import time
from typing import Any

from cryptography.hazmat.primitives.poly1305 import Poly1305

from somatize.remote.wire import _buffer

__all__ = [
    "MAGIC",
    "SALT_ASK",
    "SALT",
    "REFUSED",
    "WINDOW",
    "Refused",
    "Seal",
    "derive",
    "refusal",
    "salt_answer",
    "is_frame",
]

MAGIC = b"SMZ6"
"""The first bytes of every sealed message."""

SALT_ASK = b"SMZ6 salt?"
"""The one unsealed request: "which salt, and what is your clock?"."""

SALT = b"SMZ6 salt"
"""The first frame of the answer to `SALT_ASK`: `[SALT, salt, clock]`."""

REFUSED = b"SMZ6 refused"
"""The first frame of a refusal: `[REFUSED, salt, reason]`; reasons are `seal` (it does not
verify: another token, or a key from before a restart), `stale` and `replay`."""

WINDOW = 300.0
"""Seconds a sealed message stays acceptable, and its nonce remembered."""

REMEMBERED = 1 << 16
"""The most nonces remembered; past it the oldest half is forgotten and nothing sealed before
the newest of them is accepted any more."""

_NONCE = 16
_CLOCK = struct.Struct("<d")
_LENGTHS = struct.Struct("<Q")
_SEAL = len(MAGIC) + _NONCE + _CLOCK.size + 16
_PERSON = b"smz6 one-time"


class Refused(Exception):
    """A message that is not to be read: it does not verify, or it was sealed too long ago,
    or it was seen before (a replay). `reason` is `"seal"`, `"stale"` or `"replay"`."""

    def __init__(self, message: str, reason: str = "seal") -> None:
        super().__init__(message)
        self.reason = reason


@functools.lru_cache(maxsize=64)
def derive(token: str | bytes, salt: bytes) -> bytes:
    """The 32-byte session key of `token` (text, or its bytes) under a worker's `salt`: scrypt
    (n=2**14, r=8), about 50 ms, worked out once per token and salt in a process."""
    raw = token.encode() if isinstance(token, str) else bytes(token)
    return hashlib.scrypt(raw, salt=salt, n=1 << 14, r=8, p=1, maxmem=64 << 20, dklen=32)


def salt_answer(salt: bytes) -> list[bytes]:
    """What a worker answers `SALT_ASK` with: its salt and its clock."""
    return [SALT, salt, _CLOCK.pack(time.time())]


def refusal(salt: bytes, reason: str) -> list[bytes]:
    """What a worker answers a message it refused with (unsealed: it says why, and nothing
    more than a listener already knows)."""
    return [REFUSED, salt, reason.encode()]


def is_frame(frame: Any, word: bytes) -> bool:
    """Whether `frame` is exactly `word` (`SALT_ASK`, `SALT`, `REFUSED`)."""
    return _buffer(frame) == word


class Seal:
    """Seals and opens messages under one session key, and remembers what it opened.

    `offset` is added to this process's clock when sealing and checking (a client sets it to
    the worker's clock minus its own, so that the two agree whatever the machines' clocks).
    """

    def __init__(self, key: bytes, *, offset: float = 0.0) -> None:
        if len(key) != 32:
            raise ValueError("a session key is 32 bytes")
        self.key = key
        self.offset = offset
        self.seen: dict[bytes, float] = {}
        self.floor = float("-inf")

    def now(self) -> float:
        """This side's clock, as the other side keeps it."""
        return time.time() + self.offset

    def _tag(self, nonce: bytes, clock: bytes, frames: list[Any]) -> bytes:
        frames = [_buffer(f) for f in frames]
        one_time = hashlib.blake2b(
            nonce + clock, key=self.key, digest_size=32, person=_PERSON
        ).digest()
        mac = Poly1305(one_time)
        lengths = b"".join([_LENGTHS.pack(f.nbytes) for f in frames])
        for part in (MAGIC + nonce + clock + _LENGTHS.pack(len(frames)) + lengths, *frames):
            mac.update(part)
            mac.update(bytes(-len(part) % 16))  # to a block's end: the next starts whole
        return mac.finalize()

    def seal(self, frames: list[Any]) -> list[Any]:
        """`[seal, *frames]`: `frames` (a header and data frames) as a sealed message."""
        nonce = os.urandom(_NONCE)
        clock = _CLOCK.pack(self.now())
        return [MAGIC + nonce + clock + self._tag(nonce, clock, frames), *frames]

    def open(self, frames: list[Any]) -> list[Any]:
        """The frames under the seal of a message sealed with this key, sealed less than
        `WINDOW` seconds ago and never opened before; else `Refused`, nothing in it read."""
        first = _buffer(frames[0]) if frames else b""
        if len(first) != _SEAL or first[:4] != MAGIC:
            raise Refused("not a sealed message")
        seal = first.tobytes()
        nonce, clock, tag = seal[4:20], seal[20:28], seal[28:]
        body = frames[1:]
        if not hmac.compare_digest(self._tag(nonce, clock, body), tag):
            raise Refused("the seal does not verify: another token, or a key from before a restart")
        (sent,) = _CLOCK.unpack(clock)
        now = self.now()
        if not abs(now - sent) <= WINDOW or sent <= self.floor:
            raise Refused(f"sealed {now - sent:.0f} s from now: too long ago to accept", "stale")
        if nonce in self.seen:
            raise Refused("a message seen before (a replay)", "replay")
        self.seen[nonce] = sent
        if len(self.seen) > REMEMBERED:
            self._forget(now)
        return body

    def _forget(self, now: float) -> None:
        """Forget what is too old to be accepted anyway; if that is not enough, the oldest
        half too, and from then on accept nothing sealed before the newest of those."""
        self.seen = {n: t for n, t in self.seen.items() if now - t <= WINDOW}
        if len(self.seen) > REMEMBERED // 2:
            ordered = sorted(self.seen.items(), key=lambda item: item[1])
            half = len(ordered) // 2
            self.floor = max(self.floor, ordered[half - 1][1])
            self.seen = dict(ordered[half:])
