"""What a decode worker does with the coordinator's Admit and a prefill worker's KVReady: the
grant it reserves (`grant_blocks`: prefix-cached blocks first, then new ones), the fence that
holds a given-up grant's blocks while its writer may still write into them, and the checks a
KVReady must pass before its blocks are copied in (`handoff_problem`, `scores_problem`), and
those a streamed hand-off's KVPart must pass (`part_problem`: the next blocks of the grant, in
order; Grant.streamed counts those taken, which the closing KVReady must name).

Lifecycle: plain data and functions; the worker (worker/any_role.py) keeps its grants and fences
by request and grant number and calls these from its Admit, KVReady/KVFailed, Release and expiry
paths (its docstring tells the whole protocol).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.wire.protocol import Admit, KVPart, KVReady
from pdserve_client.errors import PdserveError
from pdserve_client.params import MAX_LOGPROBS

FENCE_CHECK_S = 0.5  # how often fenced writers are checked for death


LIVE_WRITER_GRANT_FACTOR = 10  # a grant whose local writer lives expires after this many grant timeouts


@dataclass
class Grant:
    block_ids: list[int]
    deadline: float
    number: int = 0  # this worker's count of grants: the hand-off that fills it names it
    writer: int = 0  # pid of a prefill process on this machine that may write into the blocks directly; 0: none
    cancelled: bool = False  # aborted before its KV arrived: free when the prefill side answers
    cached: int = 0  # the first `cached` blocks came from the prefix cache: the hand-off sends only the others
    last_resort: float = float("inf")  # expires at this even while its writer lives (see expire_grants)
    tokens: int = 0  # Admit.num_tokens: the tokens whose KV the hand-off brings (its num_computed)
    streamed: int = 0  # the sent blocks (sent_blocks) whose KV came in KVParts so far, in order


def sent_blocks(grant: Grant, null: int) -> list[int]:
    """The blocks of a grant its hand-off fills (KVReady.block_ids): all less the prefix-cached
    first ones and a sliding window's `null` entries, which are not sent."""
    return [b for b in grant.block_ids[grant.cached:] if b != null]


@dataclass
class Fence:
    """The blocks of a grant given up before its writer answered, held until it does or dies."""

    block_ids: list[int]
    writer: int


def scores_problem(msg: KVReady, vocab: int) -> str | None:
    """Why msg's prompt scores are not what its params asked for (None if they are): one per
    prompt token after the first, each with at most prompt_logprobs top ids inside the vocabulary."""
    k, scores = msg.params.prompt_logprobs, msg.prompt_logprobs
    if (k is None) != (scores is None):
        return "prompt logprobs that its params did not ask for, or none that they did"
    if scores is not None and (len(scores) != len(msg.prompt_token_ids) - 1
                               or any(len(top) > k or any(not 0 <= t < vocab for t, _ in top) for _, _, top in scores)):
        return f"{len(scores)} prompt scores for {len(msg.prompt_token_ids)} prompt tokens, or one with an id outside [0, {vocab}) or over {k} top ids"
    return None


def grant_blocks(blocks, msg: Admit) -> tuple[list[int], int] | None:
    """(blocks of `blocks` (the engine's block manager) for msg's tokens, how many of the first hold its prefix already), or None
    (nothing taken) if the pool is short. At most all but the last block come from the
    prefix cache, so every hand-off carries at least one block. With a sliding window on every
    layer (BlockManager.window) the positions wholly before the window of the first decoded
    position get BlockManager.NULL (runtime.kv_cache's NULL_BLOCK, -1 on the wire), not a block
    (a cached one found there is given back): the decode side never reads them, so the
    hand-off does not send them (worker/handoff.py). A model with KV groups (BlockManager.groups,
    runtime.kv_groups; no prefix cache) gets each group's table so, NULL before each sliding
    group's own window, interleaved position by position (BlockManager.interleave), which the
    prefill side's tables and hand-off follow."""
    need = blocks.blocks_for(msg.num_tokens)
    cached = blocks.match_tokens(msg.prefix_token_ids, need - 1, msg.cache_salt)
    firsts = blocks.first_needed_by_group(msg.num_tokens)
    rest = blocks.allocate(sum(need - max(len(cached), first) for first in firsts))
    if rest is None:
        blocks.free(cached)
        return None
    if blocks.prefix_cache:
        blocks.count_lookup(msg.num_tokens, len(cached) * blocks.block_size)
    tables = []
    for first in firsts:  # one group, or KV groups with nothing cached
        blocks.free(cached[:first])
        n = need - max(len(cached), first)
        tables.append([blocks.NULL] * first + cached[first:] + rest[:n])
        del rest[:n]
    return blocks.interleave(tables), len(cached)


def part_problem(msg: KVPart, grant: Grant, null: int) -> str | None:
    """Why a streamed hand-off's part is not the next blocks of its grant (None if it is): it
    starts where the parts before it ended and names the grant's sent blocks from there, leaving
    at least one for the KVReady."""
    sent = sent_blocks(grant, null)
    if msg.first != grant.streamed:
        return f"a part from block {msg.first}, {grant.streamed} streamed before it"
    if not msg.block_ids or msg.block_ids != sent[msg.first:msg.first + len(msg.block_ids)] or msg.first + len(msg.block_ids) >= len(sent):
        return f"a part of {len(msg.block_ids)} blocks that are not the grant's next ones (of {len(sent)}, the last for the KVReady)"
    return None


def handoff_problem(msg: KVReady, grant: Grant, engine) -> str | None:
    """Why msg does not fill exactly its grant (None if it does): the granted blocks (less those
    the prefix cache held), the granted tokens' KV, token ids and params `engine` (the worker's LLMEngine) accepts."""
    sent = sent_blocks(grant, engine.blocks.NULL)
    if msg.block_ids != sent:
        return f"{len(msg.block_ids)} block ids that are not the {len(sent)} granted"
    if msg.streamed != grant.streamed:
        return f"{msg.streamed} blocks streamed before it, {grant.streamed} arrived"
    total = len(msg.prompt_token_ids) + len(msg.output_token_ids)
    if not msg.prompt_token_ids or not msg.output_token_ids or not msg.num_computed == grant.tokens == total - 1:
        return (f"KV of {msg.num_computed} tokens for {len(msg.prompt_token_ids)} prompt and {len(msg.output_token_ids)} "
                f"output tokens, {grant.tokens} granted")
    vocab = engine.cfg.vocab_size
    top = msg.top_logprobs or []
    if not 0 <= msg.output_token_ids[-1] < vocab or len(top) > MAX_LOGPROBS or any(not 0 <= t < vocab for t, _ in top):
        return f"an output token id outside [0, {vocab}) or too many top logprobs"
    if msg.logprob is not None and math.isnan(msg.logprob):
        return "a NaN logprob"
    problem = scores_problem(msg, vocab)
    if problem is not None:
        return problem
    try:
        engine.validate(msg.prompt_token_ids + msg.output_token_ids[:-1], msg.params)
    except PdserveError as e:
        return str(e)
    return None
