"""API keys and their limits: who may call, and how much.

The keys file holds one key a line, with its limits as `name=value` words after it; `#` starts a comment:

    sk-team-a   name=team-a  rpm=600  tpm=200000  concurrency=16
    sk-batch    name=batch   rpm=60                      # no token or stream limit

rpm: requests a minute; tpm: tokens a minute (prompt + completion, as OpenAI counts them: a request is admitted
while the minute's budget is not spent, and its tokens are counted when it ends); concurrency: streams at once.
A limit left out is no limit. Keys are held as SHA-256 digests and looked up by the digest of what the caller
sent, so the lookup's timing depends on digests, which say nothing about how much of a guess matches a key. The file is read again when it changes (checked at most once a second), without a restart. Without a keys
file the front door is open: every caller is the key `anonymous`, with no limits.
The counting windows are the `limits` library's fixed one-minute windows (in memory: one front-door process).
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

from limits import RateLimitItemPerMinute, storage, strategies

LIMIT_NAMES = ("rpm", "tpm", "concurrency")


@dataclass(frozen=True)
class Key:
    name: str
    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None


ANONYMOUS = Key("anonymous")


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def parse_keys(text: str, path: str = "keys file") -> dict[bytes, Key]:
    """{digest: Key} from the file's text; ValueError naming the line for a malformed one."""
    keys: dict[bytes, Key] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        secret, settings = words[0], {}
        for word in words[1:]:
            name, eq, value = word.partition("=")
            if not eq or name not in ("name", *LIMIT_NAMES):
                raise ValueError(f"{path}:{number}: {word!r} is not one of name=, rpm=, tpm=, concurrency=")
            if name != "name":
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"{path}:{number}: {name}={value!r} must be a positive integer")
                settings[name] = int(value)
            else:
                settings[name] = value
        keys[digest(secret)] = Key(settings.pop("name", f"key-{number}"), **settings)
    return keys


class KeyStore:
    """The keys file, re-read when it changes; None: no file, every caller is anonymous."""

    def __init__(self, path: str | None):
        self.path = path
        self.keys: dict[bytes, Key] = {}
        self._mtime = None
        self._checked = 0.0
        if path:
            self._load()

    def _load(self) -> None:
        mtime = os.stat(self.path).st_mtime_ns
        if mtime != self._mtime:
            with open(self.path) as f:
                self.keys = parse_keys(f.read(), self.path)
            self._mtime = mtime

    def refresh(self) -> None:
        now = time.monotonic()
        if self.path and now - self._checked >= 1.0:
            self._checked = now
            try:
                self._load()
            except (OSError, ValueError):
                pass   # a half-written or removed file: keep serving with the keys last read

    def authenticate(self, authorization: str | None) -> Key | None:
        """The key a request's Authorization header names; None when keys are required and it names none."""
        if not self.path:
            return ANONYMOUS
        self.refresh()
        scheme, _, secret = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            return None
        return self.keys.get(digest(secret.strip()))


@dataclass
class Decision:
    allowed: bool
    retry_after_s: int = 0
    headers: dict | None = None
    reason: str = ""


class Limiter:
    """Per-key requests and tokens per minute, and streams at once."""

    def __init__(self):
        self.windows = strategies.FixedWindowRateLimiter(storage.MemoryStorage())
        self.streams: dict[str, int] = {}

    def admit(self, key: Key) -> Decision:
        """Count one request against its key if every limit allows it (and then take one stream)."""
        headers, now = {}, time.time()
        for kind, amount in (("requests", key.rpm), ("tokens", key.tpm)):
            if amount is None:
                continue
            item = RateLimitItemPerMinute(amount)
            stats = self.windows.get_window_stats(item, key.name, kind)
            reset = max(0.0, stats.reset_time - now)
            headers.update({f"x-ratelimit-limit-{kind}": str(amount),
                            f"x-ratelimit-remaining-{kind}": str(max(0, stats.remaining)),
                            f"x-ratelimit-reset-{kind}": f"{reset:.3f}s"})
            if stats.remaining <= 0:
                return Decision(False, max(1, int(reset + 0.999)), headers,
                                f"rate limit reached for {key.name}: {amount} {kind} per minute")
        if key.concurrency is not None and self.streams.get(key.name, 0) >= key.concurrency:
            return Decision(False, 1, headers, f"rate limit reached for {key.name}: {key.concurrency} concurrent "
                                               "requests")
        if key.rpm is not None:
            self.windows.hit(RateLimitItemPerMinute(key.rpm), key.name, "requests")
            headers["x-ratelimit-remaining-requests"] = str(max(0, int(headers["x-ratelimit-remaining-requests"]) - 1))
        self.streams[key.name] = self.streams.get(key.name, 0) + 1
        return Decision(True, 0, headers)

    def finish(self, key: Key, tokens: int) -> None:
        """A request of `key` ended having used `tokens` (prompt + completion): count them, free its stream."""
        self.streams[key.name] = max(0, self.streams.get(key.name, 0) - 1)
        self.count_tokens(key, tokens)

    def count_tokens(self, key: Key, tokens: int) -> None:
        """Count `tokens` (prompt + completion) against `key`'s minute."""
        if key.tpm is not None and tokens > 0:
            self.windows.hit(RateLimitItemPerMinute(key.tpm), key.name, "tokens", cost=tokens)
