"""vLLM's `cache_salt` over HTTP, on a launched service (coordinator, gateway, one colocated
worker: real processes on loopback, tiny model): on /v1/completions, /v1/chat/completions and
/v1/responses a salt reaches the worker's prefix cache (the same prompt again with its salt hits,
with another salt it does not, nor a salted one the unsalted prompt's, unsalted requests share as before: the worker's hits in
`pdserve stats`), and a salt that is not a string of 1 to 256 characters is a 400 in OpenAI's
error shape naming the field. At the end every KV block is free."""
import json

import httpx
import pytest

from pdserve_client.library import Client
from tests.helpers import free_port, save_tiny_served_model, start_cluster, wait_all_blocks_free

BLOCK = 8
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=512)
    launcher = start_cluster(d, tmp_path_factory.mktemp("logs"), prefill=0, decode=0, colocated=1, gateway=True, http_port=free_port(),
                             engine_args=["--num-blocks", "128", "--block-size", str(BLOCK), "--heartbeat-s", "0.1"])
    yield launcher
    launcher.stop()


def text(seed: int) -> str:
    """A prompt of several blocks that no other test's prompt begins like."""
    return " ".join(WORDS[(seed * 7 + j * 3) % len(WORDS)] for j in range(40))


def body(path: str, model: str, seed: int, salt) -> dict:
    extra = {} if salt is None else {"cache_salt": salt}
    if path == "/v1/completions":
        return {"model": model, "prompt": f"{seed} {text(seed)}", "max_tokens": 2, "temperature": 0, **extra}
    if path == "/v1/chat/completions":
        return {"model": model, "messages": [{"role": "user", "content": f"{seed} {text(seed)}"}], "max_tokens": 2, "temperature": 0, **extra}
    return {"model": model, "input": f"{seed} {text(seed)}", "max_output_tokens": 2, "temperature": 0, "store": False, **extra}


def post(url: str, path: str, payload: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=json.dumps(payload).encode(), headers={"content-type": "application/json"}, timeout=60)


PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses"]


@pytest.mark.parametrize("seed,path", list(enumerate(PATHS)))
def test_a_salt_shares_the_prefix_cache_only_within_itself(cluster, seed, path):
    url, model = cluster.plan.http_url, cluster.plan.model

    def hits(salt) -> int:
        with Client(cluster.plan.client_addr) as c:
            before = wait_all_blocks_free(c)["workers"][0]["prefix_cache"]["hits"]
            r = post(url, path, body(path, model, seed, salt))
            assert r.status_code == 200, r.text
            return wait_all_blocks_free(c)["workers"][0]["prefix_cache"]["hits"] - before

    a, b = f"tenant-a-{seed}", f"tenant-b-{seed}"  # salts of this case alone (a chat template's head is every chat's)
    hits(None)  # the prompt cached unsalted (its chat template's head may have been already)
    assert hits(a) == 0  # salted: nothing of the unsalted prompt, not even the template's head
    assert hits(a) >= 4 * BLOCK  # the prompt's full blocks, all but the last token's
    assert hits(b) == 0
    assert hits(None) >= 4 * BLOCK  # unsalted requests share as before


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("salt", ["x" * 257, "", 5, ["a"]])
def test_a_bad_salt_is_a_400_naming_it(cluster, path, salt):
    r = post(cluster.plan.http_url, path, body(path, cluster.plan.model, 9, salt))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" and err["type"] == "invalid_request_error", err


def test_a_salt_of_256_characters_is_served_and_every_block_is_free(cluster):
    for path in PATHS:
        r = post(cluster.plan.http_url, path, body(path, cluster.plan.model, 10, "\u00e9" * 256))
        assert r.status_code == 200, r.text
    with Client(cluster.plan.client_addr) as c:
        wait_all_blocks_free(c)
