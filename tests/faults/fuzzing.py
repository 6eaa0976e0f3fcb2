"""Fuzzing helpers: random and mutated ZeroMQ messages and HTTP JSON bodies, all from one seeded
`random.Random`, so a failing run replays exactly.

A message is a list of frames (what one `send_multipart` sends). `fuzz_messages` mixes, per
message: byte-level mutations of a valid encoded message (bit flips, msgpack type bytes, spans
inserted, deleted, duplicated, truncation), structural mutations (the valid message decoded
untyped, one value replaced, deleted or duplicated, re-encoded: well-formed msgpack of the wrong
shape or type), random bytes (empty included), well-formed msgpack of random values, multi-frame
messages, and a few unchanged valid messages. `mutate_json` does the same for JSON bodies.
"""
from __future__ import annotations

import json
import random
import string

import msgspec

INTERESTING_INTS = [0, 1, -1, 2, 3, 127, 128, 255, 256, -129, 2**15, 2**16, 2**31 - 1, -(2**31), 2**32, 2**53, 2**63 - 1,
                    -(2**63), 2**64 - 1]
INTERESTING_FLOATS = [0.0, -0.0, 1.5, -1.0, 1e-310, 1e308, -1e308, float("inf"), float("-inf"), float("nan")]
MSGPACK_BYTES = [0x00, 0x01, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc2, 0xc3, 0xc4, 0xc5, 0xc6, 0xc7, 0xca,
                 0xcb, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd3, 0xd4, 0xd9, 0xda, 0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0xe0, 0xff]
_TEXT = string.printable + "é€😀\u0000\u202e"


def random_text(rng: random.Random, prefix: str = "fz") -> str:
    # the prefix keeps fuzzed ids apart from the coordinator's own ("r0", "r1", ...)
    return prefix + "".join(rng.choice(_TEXT) for _ in range(rng.randrange(0, 24)))


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(11)
    if kind == 0:
        return rng.choice(INTERESTING_INTS)
    if kind == 1:
        return rng.choice(INTERESTING_FLOATS)
    if kind == 2:
        return random_text(rng, rng.choice(["", "fz"]))
    if kind == 3:
        return rng.randbytes(rng.randrange(0, 64))
    if kind == 4:
        return None
    if kind == 5:
        return rng.random() < 0.5
    if kind == 6 and depth < 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if kind == 7 and depth < 3:
        return {random_text(rng, ""): random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}
    if kind == 8:
        return "x" * rng.choice([1000, 70_000])
    if kind == 9:
        nested = []
        for _ in range(rng.randrange(10, 120)):
            nested = [nested]
        return nested
    return rng.choice([rng.randrange(-3, 300), 10**30])  # 10**30: past 64 bits (JSON only)


def _slots(obj, out, depth=0):
    """Every (container, key) position inside a decoded message."""
    if depth > 6:
        return out
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((obj, i))
            _slots(v, out, depth + 1)
    elif isinstance(obj, dict):
        for k, v in list(obj.items()):
            out.append((obj, k))
            _slots(v, out, depth + 1)
    return out


def mutate_tree(rng: random.Random, tree):
    """One structural change to a decoded (untyped) message; returns the new tree."""
    slots = _slots(tree, [])
    if not slots:
        return random_value(rng)
    container, key = rng.choice(slots)
    op = rng.randrange(4)
    if op == 0 or op == 3:
        container[key] = random_value(rng)
    elif op == 1:
        if isinstance(container, list):
            container.pop(key)
        else:
            del container[key]
    elif op == 2:
        if isinstance(container, list):
            container.insert(key, random_value(rng) if rng.random() < 0.5 else container[key])
        else:
            container[random_text(rng, "")] = random_value(rng)
    return tree


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        i = rng.randrange(len(b) + 1)
        if op == 0 and i < len(b):
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and i < len(b):
            b[i] = rng.choice(MSGPACK_BYTES)
        elif op == 2:
            b[i:i] = rng.randbytes(rng.randrange(1, 9))
        elif op == 3 and b:
            del b[i:i + rng.randrange(1, 9)]
        elif op == 4:
            del b[i:]
        elif op == 5 and i < len(b):
            b[i:i] = b[i:i + rng.randrange(1, 17)]
    return bytes(b)


def structural(rng: random.Random, data: bytes) -> bytes:
    for _ in range(5):
        tree = mutate_tree(rng, msgspec.msgpack.decode(data))
        try:
            return msgspec.msgpack.encode(tree)
        except OverflowError:  # an int past 64 bits: msgpack cannot say it
            continue
    return mutate_bytes(rng, data)


def random_msgpack(rng: random.Random) -> bytes:
    while True:
        try:
            return msgspec.msgpack.encode(random_value(rng))
        except OverflowError:
            continue


def fuzz_messages(rng: random.Random, templates: list[list[bytes]], n: int):
    """n fuzzed messages (lists of frames) from valid templates (lists of frames)."""
    for _ in range(n):
        frames = list(rng.choice(templates))
        r = rng.random()
        if r < 0.35:
            frames[0] = mutate_bytes(rng, frames[0])
        elif r < 0.65:
            frames[0] = structural(rng, frames[0])
        elif r < 0.78:
            frames = [rng.randbytes(rng.choice([0, 1, 2, 5, 16, 64, 512, 4096, 65536]))]
        elif r < 0.84:
            frames = [random_msgpack(rng)]
        elif r < 0.96:  # multi-frame: extra, missing or mutated trailing frames
            k = rng.randrange(3)
            if k == 0 or len(frames) == 1:
                frames = frames + [rng.randbytes(rng.randrange(0, 256)) for _ in range(rng.randint(1, 3))]
            elif k == 1:
                frames = frames[:rng.randrange(1, len(frames))]
            else:
                j = rng.randrange(1, len(frames))
                frames[j] = mutate_bytes(rng, frames[j])
        # else: the valid template unchanged
        yield frames


# ------------------------------------------------------------------ HTTP JSON bodies

def mutate_json(rng: random.Random, base: dict) -> tuple[bytes, dict]:
    """A mutated body for a JSON request (bytes) and extra headers."""
    r = rng.random()
    tree = json.loads(json.dumps(base))
    headers = {"content-type": "application/json"}
    if r < 0.55:  # structural: the body stays JSON (stdlib json writes NaN, Infinity and big ints too)
        for _ in range(rng.randint(1, 3)):
            tree = mutate_tree(rng, tree)
        if rng.random() < 0.1:  # a lone surrogate: valid JSON escape, invalid Unicode
            strings = [(c, k) for c, k in _slots(tree, []) if isinstance(c[k], str)]
            if strings:
                c, k = rng.choice(strings)
                c[k] = "\ud800" + c[k]
        return json.dumps(_jsonable(tree)).encode(), headers
    body = msgspec.json.encode(tree)
    if r < 0.8:
        return mutate_bytes(rng, body), headers
    if r < 0.87:
        return rng.choice([b"", b"null", b"[]", b"\"x\"", b"1e999", b"{\"model\":", b"\xef\xbb\xbf{}", b"\xff\xfe\x00",
                           b"{" * 5000, b"[" * 100_000, b"{\"model\": \"\\ud800\"}"]), headers
    if r < 0.93:
        return body, {"content-type": rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])}
    return rng.randbytes(rng.randrange(0, 2048)), headers


def _jsonable(obj):
    """JSON has no bytes: they become hex strings."""
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    return obj
