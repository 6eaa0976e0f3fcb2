"""`prompt_logprobs: 20` on a long prompt is served (issue 38), through a launched service (a
colocated worker on a tiny model of 4096 positions, real processes on loopback): its scores, one
delta of ~2.7 KB a token as the gateway counts them, were counted against the 4 MiB of events one
HTTP request may leave unread (--stream-buffer-kb), so a prompt over ~1,525 tokens ended
`client_too_slow` before any client could read anything (measured: a 2,000-token prompt failed
whole and streamed). The scores are bounded at admission instead (max_scored_entries, prompt
tokens x n x (1 + k)), so they no longer count there; a client that stops reading the tokens after
them is still held to the buffer."""
import json

import httpx
import pytest

from tests.helpers import free_port, save_tiny_served_model, start_cluster

PROMPT = 2000


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    d = tmp_path_factory.mktemp("served-4096")
    save_tiny_served_model(d, max_position_embeddings=4096)
    launcher = start_cluster(d, tmp_path_factory.mktemp("logs"), prefill=0, decode=0, colocated=1, gateway=True, http_port=free_port(),
                             engine_args=["--kv-cache-mb", "32"], coordinator_args=["--no-slo"])
    yield launcher
    launcher.stop()


def body(service, **kw) -> dict:
    name = httpx.get(f"{service.plan.http_url}/v1/models", timeout=10).json()["data"][0]["id"]
    ids = [100 + (i * 7919) % 40000 for i in range(PROMPT)]
    return {"model": name, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 20, "temperature": 0, **kw}


def test_twenty_prompt_logprobs_of_a_long_prompt_are_served_whole(service):
    r = httpx.post(f"{service.plan.http_url}/v1/completions", json=body(service, n=2), timeout=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:  # the second choice shares the first's scores (gateway/scoring.py)
        field = choice["prompt_logprobs"]
        assert len(field) == PROMPT and field[0] is None and all(len(e) >= 20 for e in field[1:])


def test_twenty_prompt_logprobs_of_a_long_prompt_are_served_streamed(service):
    seen = []
    with httpx.stream("POST", f"{service.plan.http_url}/v1/completions", json=body(service, stream=True), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                seen += [c["prompt_logprobs"] for c in event["choices"] if c.get("prompt_logprobs")]
    assert len(seen) == 1 and len(seen[0]) == PROMPT
