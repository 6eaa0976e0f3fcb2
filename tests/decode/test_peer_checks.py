"""Peers are checked: every count and index a worker-to-worker message carries (KVReady on the
kv socket, Prefill and Generate from the coordinator) is checked before it reaches a copy, the
engine or C. A bad one fails that request only, with a typed error, and frees its blocks; the
worker goes on serving the others, and every pool ends whole.

In one process: a tiny model's decode and prefill workers over the in-process KV transport
(kvtransfer.local) and fake links, as tests/decode/test_worker.py builds them; the kv socket's
own checks run on a real KVReceiver bound on loopback.
"""
import msgspec
import pytest
import torch
import zmq

from pdserve.kvtransfer.transfer import KVReceiver
from pdserve.wire.protocol import Generate, KVFailed, KVReady, Prefill, PrefillDone, WorkerError
from pdserve_client.params import StructuredOutput
from pdserve_client.protocol import encode
from tests.decode.test_worker import GREEDY, admit, all_free, deliver, tokens_of, workers
from tests.helpers import free_port

PROMPTS = {"bad": list(range(3, 23)), "good": list(range(40, 61))}  # 20 and 21 tokens: 3 blocks of 8 each


def handed_off(tiny):
    """Both prompts prefilled and their KVReady waiting in the decode worker's kv inbox."""
    p, d, inbox = workers(tiny)
    for rid, prompt in PROMPTS.items():
        p.link.inbox.append(Prefill(rid, prompt, GREEDY, "decode-1", "local://decode-1", admit(d, rid, len(prompt))))
    while p.jobs or p.link.inbox:
        p.turn(0)
    assert all_free(p) and [m.request_id for m, _ in inbox] == ["bad", "good"]
    return p, d, inbox


def run_to_end(d) -> None:
    while d.link.inbox or d.engine.has_work():
        d.turn(0)


@pytest.mark.parametrize("tamper", [
    lambda m: {"num_computed": -5},  # once a negative row index in C
    lambda m: {"num_computed": m.num_computed + 1},
    lambda m: {"block_ids": m.block_ids[:-1]},  # fewer blocks than granted for its tokens
    lambda m: {"block_ids": [*m.block_ids[:-1], 10**6]},  # outside the pool
    lambda m: {"block_ids": [*m.block_ids[:-1], m.block_ids[0]]},  # in the pool, not all this grant's
    lambda m: {"prompt_token_ids": m.prompt_token_ids[:-1]},  # fewer tokens than the KV it claims
    lambda m: {"output_token_ids": [10**9]},
    lambda m: {"prompt_token_ids": [-1, *m.prompt_token_ids[1:]]},
    lambda m: {"output_token_ids": []},
    lambda m: {"top_logprobs": [(1, -0.5)] * 40},
], ids=["negative-num-computed", "num-computed-past-tokens", "too-few-blocks", "block-out-of-range", "block-not-granted",
        "prompt-shorter-than-kv", "output-out-of-vocab", "prompt-out-of-vocab", "no-output", "too-many-top-logprobs"])
def test_a_bad_hand_off_fails_only_its_request(tiny, tamper):
    _, d, inbox = handed_off(tiny)
    bad, frames = inbox[0]
    inbox[0] = (msgspec.structs.replace(bad, **tamper(bad)), frames)
    deliver(d, inbox)
    run_to_end(d)
    errors = d.link.taken(WorkerError)
    assert [(e.request_id, e.code) for e in errors] == [("bad", "kv_transfer_failed")] and "invalid hand-off" in errors[0].message
    out = tokens_of(d)
    assert "bad" not in out and len(out["good"]) == GREEDY.max_tokens  # the other request is served in full
    assert d.receiver.bad_messages == 1 and not d.grants and all_free(d)


def test_a_bad_prefill_fails_before_any_compute_and_tells_the_decode_side(tiny):
    p, d, inbox = workers(tiny)
    blocks = {rid: admit(d, rid, len(prompt)) for rid, prompt in PROMPTS.items()}
    prompt = PROMPTS["bad"]
    bad = [
        Prefill("bad", prompt, GREEDY, "decode-1", "local://decode-1", blocks["bad"][:-1]),  # too few blocks
        Prefill("bad", prompt, GREEDY, "decode-1", "local://decode-1", blocks["bad"], dest_cached_blocks=-1),
        Prefill("bad", prompt, GREEDY, "decode-1", "local://decode-1", blocks["bad"], dest_cached_blocks=3),
        Prefill("bad", prompt, GREEDY, "decode-1", "local://decode-1", [-1, *blocks["bad"][1:]]),  # would write another block
        Prefill("bad", prompt, GREEDY, "decode-1", "local://decode-1", [*blocks["bad"]], output_token_ids=[10**9]),
    ]
    for msg in bad:
        p.link.inbox.append(msg)
        p.turn(0)
        assert [m.request_id for m, _ in inbox if isinstance(m, KVFailed)] == ["bad"], msg
        inbox.clear()
    errors = p.link.taken(WorkerError)
    assert [e.code for e in errors] == ["kv_transfer_failed"] * 4 + ["invalid_request"] and not p.link.taken(PrefillDone)
    assert all_free(p)
    p.link.inbox.append(Prefill("good", PROMPTS["good"], GREEDY, "decode-1", "local://decode-1", blocks["good"]))
    p.turn(0)  # the worker goes on: the next prompt is handed off
    assert [m.request_id for m in p.link.taken(PrefillDone)] == ["good"] and all_free(p)


def test_a_bad_generate_fails_only_its_request(tiny):
    _, d, _ = workers(tiny)
    d.link.inbox += [Generate("bad", [5, 6, 7], GREEDY, output_token_ids=[10**9]), Generate("bad2", [-3, 6], GREEDY),
                     Generate("good", [5, 6, 7], GREEDY)]
    run_to_end(d)
    assert [(e.request_id, e.code) for e in d.link.taken(WorkerError)] == [("bad", "invalid_request"), ("bad2", "invalid_request")]
    assert len(tokens_of(d)["good"]) == GREEDY.max_tokens and all_free(d)


def kv_ready(block_ids, backend, params=GREEDY) -> KVReady:
    return KVReady("r", [5, 6, 7], [8], params, block_ids, 3, backend, grant=4)


def test_the_kv_socket_turns_a_bad_header_into_a_failure_of_its_grant_and_takes_any_header_up_to_the_limit():
    pool = torch.zeros(2, 2, 16, 8, 2, 16)  # (layers, 2, blocks, block size, kv heads, head dim): 32 KiB a layer
    ctx = zmq.Context()
    rx = KVReceiver(ctx, pool, f"tcp://127.0.0.1:{free_port()}")
    tx = ctx.socket(zmq.DEALER)
    tx.connect(rx.endpoint)
    try:
        def through(*frames):
            tx.send_multipart(list(frames))
            assert rx.sock.poll(5000)
            return rx.recv()

        layer = pool[0][:, :1].contiguous().numpy().tobytes()  # one block's frame of one layer
        for msg, frames, why in [
            (kv_ready([16], "tcp"), [layer, layer], "outside the pool"),
            (kv_ready([-1], "shm"), [], "outside the pool"),
            (kv_ready([1], "tcp"), [layer], "layer frames"),
            (kv_ready([1], "tcp"), [layer, layer[:-4]], "wrong size"),
        ]:
            failed, rest = through(encode(msg), *frames)
            assert isinstance(failed, KVFailed) and (failed.request_id, failed.grant) == ("r", 4) and why in failed.reason
            assert rest == []
        assert rx.bad_messages == 4
        # a 2 MiB header (a big structured spec) on a pool whose layer is 32 KiB arrives whole
        big = msgspec.structs.replace(GREEDY, structured=StructuredOutput("json", '{"description": "%s"}' % ("x" * 2**21)))
        ready, _ = through(encode(kv_ready([1], "tcp", big)), layer, layer)
        assert isinstance(ready, KVReady) and ready.params.structured.spec == big.structured.spec and rx.bad_messages == 4
    finally:
        tx.close(linger=0)
        rx.close()
        ctx.term()
