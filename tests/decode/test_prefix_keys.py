"""The decode worker's prefix cache under keyed block keys, in one process (a tiny model, the
in-process KV transport, a fake link): it keys its blocks with the secret its coordinator's
Welcome names (a new secret empties its cache), its heartbeat reports 16-byte keys the
coordinator computes alike, and with every key forced to collide an Admit whose prefix tokens
differ from the cached block's is granted no cached block (a counted mismatch), while one whose
tokens equal it still hits; every request gets the single-process engine's tokens, every pool whole."""
import msgspec
import pytest

from pdserve.common.prefix_hash import chain_hashes, new_secret
from pdserve.wire.protocol import PROTOCOL_VERSION, Admit, Granted, Heartbeat, Prefill, Welcome, WorkerToCoordinator
from pdserve_client.protocol import decoder, encode
from tests.decode.test_worker import DEST, GREEDY, all_free, deliver, tokens_of, workers
from tests.helpers import force_colliding_keys, tiny_engine

BS = 8


def serve(p, d, inbox, rid: str, prompt: list[int]) -> Granted:
    """Admit (with its prefix tokens, as the coordinator sends them), prefill, decode to the end."""
    full = (len(prompt) - 1) // BS * BS
    d.link.inbox.append(Admit(rid, len(prompt), 1, prefix_token_ids=prompt[:full]))
    d.turn(0)
    g = [m for m in d.link.taken(Granted) if m.request_id == rid][-1]
    p.link.inbox.append(Prefill(rid, prompt, GREEDY, "decode-1", DEST, g.block_ids, grant=g.grant, dest_cached_blocks=g.cached_blocks))
    while p.jobs or p.link.inbox:
        p.turn(0)
    deliver(d, inbox)
    while d.link.inbox or d.engine.has_work():
        d.turn(0)
    return g


def reference(tiny, prompts):
    eng, _ = tiny_engine(tiny, prefix_cache=False)
    return [c.token_ids for c in eng.generate(prompts, GREEDY)]


def test_welcome_secret_keys_the_cache_and_the_heartbeat(tiny):
    p, d, inbox = workers(tiny)
    prompt = list(range(3, 30))
    serve(p, d, inbox, "a", prompt)
    assert d.engine.blocks.cached_blocks > 0
    secret = new_secret()
    d.link.welcome = p.link.welcome = Welcome(PROTOCOL_VERSION, 0.0, secret)
    d.heartbeat()  # the changes so far, under the worker's own random secret
    d.turn(0)
    assert d.engine.blocks.prefix_key == secret and d.engine.blocks.cached_blocks == 0  # a new secret: nothing cached
    assert d.heartbeat().prefix_added == []
    g = serve(p, d, inbox, "b", prompt)
    assert g.cached_blocks == 0
    beat = decoder(WorkerToCoordinator).decode(encode(d.heartbeat()))  # as the coordinator reads it
    keys = chain_hashes(prompt, BS, secret, (len(prompt) - 1) // BS)  # the coordinator's keys (RequestState.prefix_hashes)
    assert all(len(k) == 16 for k in beat.prefix_added) and set(keys) <= set(beat.prefix_added)
    g = serve(p, d, inbox, "c", prompt)
    assert g.cached_blocks == len(keys)
    assert tokens_of(d) == dict(zip("abc", reference(tiny, [prompt] * 3)))
    assert all_free(p) and all_free(d)


def test_heartbeat_keys_must_be_16_bytes():
    with pytest.raises(msgspec.ValidationError):
        decoder(WorkerToCoordinator).decode(encode(Heartbeat("w", 1, 0, 0, 0, prefix_added=[b"short"])))


def test_colliding_keys_never_hand_a_request_another_prompts_blocks(tiny, monkeypatch):
    force_colliding_keys(monkeypatch)
    p, d, inbox = workers(tiny)
    victim, other = list(range(3, 30)), list(range(200, 227))
    assert serve(p, d, inbox, "victim", victim).cached_blocks == 0
    assert serve(p, d, inbox, "other", other).cached_blocks == 0  # its key is the victim's block's; its tokens are not
    assert d.engine.blocks.mismatches >= 1
    assert serve(p, d, inbox, "again", victim).cached_blocks == 1  # the victim's first block, confirmed, still hits
    assert tokens_of(d) == dict(zip(["victim", "other", "again"], reference(tiny, [victim, other, victim])))
    assert all_free(p) and all_free(d)
