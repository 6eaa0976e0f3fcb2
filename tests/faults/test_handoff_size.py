"""No message can outgrow its socket, on a small pool: the issue's reproduction. With a 1 MiB KV
pool (what the `auto` size gives in a container with a small /dev/shm) a layer is under 1 MiB,
and the kv socket once dropped any frame past max(one layer, 1 MiB): a chat with a JSON schema
carrying a 1.2 MB description made a KVReady header past that, which zmq dropped with its
connection; the request got no answer and its decode blocks stayed fenced while the prefill
worker lived. Now the hand-off arrives (or, where an entry bound refuses such a spec, the request
is refused with limit_exceeded) and the decode pool is whole afterwards.

Real processes on loopback: a coordinator, one prefill and one decode worker, the tiny model.
"""
import json

import pytest

from pdserve_client.library import Client, InvalidRequest
from pdserve_client.params import StructuredOutput
from tests.helpers import save_tiny_served_model, start_cluster, wait_all_blocks_free

DESCRIPTION_BYTES = 1_200_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=256)
    launcher = start_cluster(d, tmp_path_factory.mktemp("logs"), engine_args=["--kv-cache-mb", "1"])
    yield launcher
    launcher.stop()


def test_a_hand_off_header_larger_than_a_pool_layer_arrives_and_the_pool_ends_whole(cluster):
    schema = json.dumps({"type": "object", "description": "x" * DESCRIPTION_BYTES,
                         "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    with Client(cluster.plan.client_addr, timeout=60) as c:
        decode = next(w for w in c.stats()["workers"] if w["role"] == "decode")
        layer = decode["total_blocks"] * decode["block_size"] * 2 * 2 * 16 * 4  # (k, v) x kv heads x head dim x fp32
        assert layer < 2**20 < DESCRIPTION_BYTES  # the old limit, max(one layer, 1 MiB), was below the header
        try:
            r = c.generate(token_ids=[5, 6, 7], temperature=0, max_tokens=4, structured=StructuredOutput("json", schema))
            assert r.completion_tokens >= 1 and r.decode_worker == decode["id"]
        except InvalidRequest as e:
            assert e.code == "limit_exceeded"  # a bound at the entry refused the spec: typed, at once
        stats = wait_all_blocks_free(c, timeout=15)
        assert stats["requests"].get("lost_handoffs", 0) == 0
        assert all(w["fenced_blocks"] == 0 for w in stats["workers"])
        # the node serves on: the next request is handed off over the same kv connection
        assert c.generate(token_ids=[5, 6, 7], temperature=0, max_tokens=3, ignore_eos=True).completion_tokens == 3
        wait_all_blocks_free(c, timeout=15)
