"""Which engine replica serves a request. Each replica keeps the KV blocks of the prompts it has seen
(the scheduler's prefix cache), so a request whose prompt starts like an earlier one is cheapest on the
replica that served that one: its prefill skips the shared blocks. The router therefore sends requests
that share a prefix to one replica, picked by a hash of the prefix, as long as that replica has room
in its running batch; past that, a queued request would wait longer than recomputing the prefix costs,
so it goes to the least loaded replica instead."""

from __future__ import annotations

import hashlib
import json

# How much of the prompt names its prefix: ~128 tokens of English (8 KV blocks of 16). Prompts that
# agree on this much share a replica; a shorter shared start (a one-line system prompt) is not worth
# concentrating load for, so it does not decide on its own.
PREFIX_CHARS = 512


def prefix_text(body: bytes) -> str | None:
    """The start of the prompt a request's body carries; None when it carries none (not JSON, a GET).
    Chat: the messages up to and including the first user message, which every later turn of the same
    conversation repeats, as does every request under one long system prompt. Completions: the prompt."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    messages = data.get("messages")
    if isinstance(messages, list):
        return _conversation_start(messages)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt[:PREFIX_CHARS]
    if isinstance(prompt, list):  # token ids: ~4 characters each
        return json.dumps(prompt[: PREFIX_CHARS // 4])
    return None


def _conversation_start(messages: list) -> str:
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            break
        parts.append(f"{m.get('role')}\x00{m.get('content')}\x00")
        if m.get("role") == "user":
            break
    return "".join(parts)[:PREFIX_CHARS]


def preferred_replica(prefix: str, replicas: int) -> int:
    # a stable hash: Python's hash() of a str differs between processes, and the gateway may restart
    digest = hashlib.blake2b(prefix.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % replicas


class Router:
    """Load and health as the gateway sees them: requests in flight per replica (the gateway starts
    and ends each one, so its count is exact while it is the only gateway), and which replicas are down
    (failed, and not yet seen answering again)."""

    def __init__(self, replicas: int, room: int) -> None:
        """room: requests in flight beyond which the preferred replica counts as busy (its batch size)."""
        if replicas < 1 or room < 1:
            raise ValueError(f"replicas={replicas}, room={room}: use >= 1")
        self.replicas, self.room = replicas, room
        self.in_flight = [0] * replicas
        self.down = [False] * replicas

    def order(self, prefix: str | None) -> tuple[list[int], str]:
        """The replicas to try, best first, and why the first was chosen ("affinity" or "least_loaded").
        Replicas that are down come last, whatever their load: they may be back by then."""
        by_load = sorted(range(self.replicas), key=lambda i: (self.down[i], self.in_flight[i], i))
        if prefix is None:
            return by_load, "least_loaded"
        first = preferred_replica(prefix, self.replicas)
        if self.down[first] or self.in_flight[first] >= self.room:
            return by_load, "least_loaded"
        return [first] + [i for i in by_load if i != first], "affinity"

    def started(self, replica: int) -> None:
        self.in_flight[replica] += 1

    def finished(self, replica: int) -> None:
        self.in_flight[replica] -= 1

    def failed(self, replica: int) -> None:
        self.down[replica] = True

    def recovered(self, replica: int) -> None:
        self.down[replica] = False
