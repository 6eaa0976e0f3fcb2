"""Prefix-cache block keys: a full KV block's tokens hashed, chained to the previous block's key.

Lifecycle: pure functions, no state and no torch, so the coordinator (placement by cached
prefix) may import it. A key is 128 bits of BLAKE2b keyed
with a secret (`new_secret`): the coordinator makes one at start and hands it to every worker in
its Welcome, so each process of a deployment computes the same key for the same tokens at the
same block position and block size (which lets a worker's heartbeat name its cached blocks to
the coordinator), while no one without the secret can compute keys, let alone collisions,
offline. A worker started without a coordinator keys with a random secret of its own. The cache
never trusts a key alone: a hit is confirmed against the block's tokens (runtime.kv_cache).

A request's `cache_salt` (SamplingParams; vLLM's field of that name) starts its chain from a root
of its own (`root_hash`: the salt keyed with the secret, in a domain apart from block keys), so
requests with different salts, or one salted and one not, never share a block, while those with
the same salt do; an unsalted chain starts from ROOT_HASH, so unsalted requests share as before.
"""
from __future__ import annotations

import hashlib
import secrets
from array import array

KEY_BYTES = 16  # a block key's size (128 bits)
SECRET_BYTES = 32  # a deployment's secret (BLAKE2b takes up to 64)
ROOT_HASH = bytes(KEY_BYTES)  # the chain's start: the key "before" a sequence's first block (no salt)
SALT_PERSON = b"pdserve-salt"  # BLAKE2b's personalization for salted roots: never equal to a block key's input


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def root_hash(secret: bytes, salt: str | None = None) -> bytes:
    """The key "before" a first block: ROOT_HASH without a salt, else the salt keyed with secret."""
    if salt is None:
        return ROOT_HASH
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=KEY_BYTES, key=secret, person=SALT_PERSON).digest()


def block_hash(secret: bytes, prev: bytes, tokens: list[int]) -> bytes:
    """A full block's key: its tokens chained to the previous block's key, keyed by secret."""
    h = hashlib.blake2b(prev, digest_size=KEY_BYTES, key=secret)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(tokens: list[int], block_size: int, secret: bytes, upto_blocks: int | None = None,
                 known: list[bytes] | None = None, salt: str | None = None) -> list[bytes]:
    """The chained keys of tokens' full blocks (at most upto_blocks), extending `known` (a prefix of
    them, made with the same salt), from the root of `salt` (root_hash)."""
    out = list(known or [])
    n = len(tokens) // block_size if upto_blocks is None else min(upto_blocks, len(tokens) // block_size)
    prev = out[-1] if out else root_hash(secret, salt)
    for i in range(len(out), n):
        prev = block_hash(secret, prev, tokens[i * block_size:(i + 1) * block_size])
        out.append(prev)
    return out
