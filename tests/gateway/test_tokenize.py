"""vLLM's /tokenize, /detokenize and /version on a launched service (coordinator, gateway, one
colocated worker: real processes on loopback): the tokens are the tokenizer's, a chat's count
is the prompt_tokens its chat completion reports, detokenize inverts tokenize, max_model_len is
the workers', and bad bodies are 400s naming the field. A gateway with an API key and no
workers wants the key and still answers, with the model's own context length."""
import httpx
import pytest

from pdserve.common.tokenizer import load_tokenizer, render_chat
from tests.gateway.helpers import start_gateway_cluster
from tests.helpers import free_port, save_tiny_served_model, start_cluster

CONTEXT = 1024
MAX_MODEL_LEN = 512
KEY = "tok-key-9c1e"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=CONTEXT)
    return d


@pytest.fixture(scope="module")
def url(model_dir, tmp_path_factory):
    launcher = start_cluster(model_dir, tmp_path_factory.mktemp("logs"), prefill=0, decode=0, colocated=1, gateway=True,
                             http_port=free_port(), engine_args=["--kv-cache-mb", "8", "--max-model-len", str(MAX_MODEL_LEN)])
    yield launcher.plan.http_url
    launcher.stop()


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(str(model_dir))


def post(url, path, body, **kw):
    return httpx.post(f"{url}{path}", json=body, timeout=30, **kw)


def test_version(url):
    r = httpx.get(f"{url}/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": "0.1.0"}


def test_tokenize_a_prompt(url, tok, model_dir):
    text = "Hello there, general Kenobi."
    r = post(url, "/tokenize", {"model": model_dir.name, "prompt": text})
    assert r.status_code == 200, r.text
    want = tok.encode(text, add_special_tokens=True)
    assert r.json() == {"count": len(want), "max_model_len": MAX_MODEL_LEN, "tokens": want, "token_strs": None}
    r = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text, add_special_tokens=False)
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])


def test_tokenize_a_chat_counts_what_the_chat_completion_uses(url, tok, model_dir):
    r = post(url, "/tokenize", {"model": model_dir.name, "messages": CHAT})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == render_chat(tok, CHAT) and r.json()["count"] == len(r.json()["tokens"])
    done = post(url, "/v1/chat/completions", {"model": model_dir.name, "messages": CHAT, "max_tokens": 2})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["prompt_tokens"] == r.json()["count"]
    bare = post(url, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False), add_special_tokens=False)
    assert bare["count"] < r.json()["count"]
    cont = post(url, "/tokenize", {"messages": CHAT + [{"role": "assistant", "content": "Par"}], "add_generation_prompt": False,
                                   "continue_final_message": True}).json()
    assert tok.decode(cont["tokens"]).endswith("Par")


def test_detokenize_inverts_tokenize(url, tok):
    text = "Once upon a time, in a land far away."
    ids = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = post(url, "/detokenize", {"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    special = post(url, "/detokenize", {"tokens": [tok.bos_token_id, *ids]}).json()["prompt"]
    assert special == tok.decode([tok.bos_token_id]) + text  # special tokens are kept, as vLLM does


@pytest.mark.parametrize("path, body, status, needle", [
    ("/tokenize", {"model": "other", "prompt": "hi"}, 404, "does not exist"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages must not be empty"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "cannot both be true"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "token id 1000000000 is out of range"),
    ("/detokenize", {"tokens": [-1]}, 400, "out of range"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "does not exist"),
])
def test_bad_bodies_are_typed_errors(url, path, body, status, needle):
    r = post(url, path, body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_bad_json_is_400(url):
    r = httpx.post(f"{url}/tokenize", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_key_and_no_workers(model_dir, tmp_path):
    launcher = start_gateway_cluster(model_dir, tmp_path, prefill=0, decode=0, api_key=KEY)
    try:
        url = launcher.plan.http_url
        assert post(url, "/tokenize", {"prompt": "hi"}).status_code == 401
        assert post(url, "/detokenize", {"tokens": [1]}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = post(url, "/tokenize", {"prompt": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["max_model_len"] == CONTEXT  # no worker: the model's own context
        assert httpx.get(f"{url}/version", timeout=10).status_code == 200  # open, like /health
    finally:
        launcher.stop()
