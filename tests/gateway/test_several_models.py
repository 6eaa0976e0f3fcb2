"""Two models behind one gateway, as a user starts them: `pdserve launch --model PATH=NAME` twice
(one coordinator and one colocated worker per model, real processes on loopback). Each model
answers greedy output identical to the in-process runtime on that model; /v1/models lists both;
/tokenize routes by `model` and takes the first without one; an unknown model is OpenAI's 404
model_not_found; /metrics labels each coordinator's figures with its model and stays
promtool-clean; every KV pool is whole at the end and the launch stops cleanly."""
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from pdserve.common.tokenizer import load_tokenizer
from pdserve.gateway.format import TokenText
from pdserve.launch import PORTS_PER_MODEL, port_plus
from pdserve_client.library import Client
from tests.gateway.helpers import exposition_problems, scrape, value
from tests.helpers import free_port, save_tiny_served_model, wait_all_blocks_free

NAMES = ("alpha", "beta")
PROMPTS = ([5, 17, 300, 1200, 42, 7], [900, 901, 902])
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two tiny random Llamas that differ (their seeds), with the default model's tokenizer beside each."""
    dirs = [tmp_path_factory.mktemp(name) for name in NAMES]
    for seed, d in enumerate(dirs):
        save_tiny_served_model(d, seed=seed, max_position_embeddings=256)
    return dirs


@pytest.fixture(scope="module")
def service(model_dirs, tmp_path_factory):
    """`pdserve launch --model A=alpha --model B=beta --colocated`; yields (gateway URL, each model's coordinator address)."""
    logs = tmp_path_factory.mktemp("logs")
    clients, http = f"tcp://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    models = [a for d, name in zip(model_dirs, NAMES) for a in ("--model", f"{d}={name}")]
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "launch", *models, "--colocated", "--clients", clients,
                             "--workers", f"tcp://127.0.0.1:{free_port()}", "--http-port", http.rsplit(":", 1)[1], "--threads", "1",
                             "--log-dir", str(logs), "--engine-arg=--kv-cache-mb=8", "--linear-backend", "rules"],
                            stderr=open(logs / "launch.err", "w"))
    try:
        deadline = time.monotonic() + 120
        while not ready(http):
            assert proc.poll() is None, (logs / "launch.err").read_text()
            assert time.monotonic() < deadline, "the two models were not ready in 120 s"
            time.sleep(0.2)
        yield http, [clients, port_plus(clients, PORTS_PER_MODEL)]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, (logs / "launch.err").read_text()


def ready(http: str) -> bool:
    try:
        return httpx.get(f"{http}/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def expected(model_dirs):
    """Each model's greedy answers from the in-process runtime: (text, token ids) per prompt."""
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine
    from pdserve_client.params import SamplingParams

    out, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # as the launched workers run (--threads 1)
    try:
        for d in model_dirs:
            engine = LLMEngine.load(str(d), EngineConfig(num_blocks=32, linear_backend="rules"), progress=False)
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            done = [engine.generate([p], params)[0] for p in PROMPTS]  # one at a time, as the test sends them
            out.append([(c.text, c.token_ids) for c in done])
    finally:
        torch.set_num_threads(threads)
    return out


def test_each_model_answers_as_the_runtime_does_on_it(service, expected, model_dirs):
    http, _ = service
    text = TokenText(load_tokenizer(str(model_dirs[0])))  # both models have this tokenizer
    for name, answers in zip(NAMES, expected):
        for prompt, (want_text, want_ids) in zip(PROMPTS, answers):
            r = httpx.post(f"{http}/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                           "ignore_eos": True, "logprobs": 0}, timeout=60)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert r.json()["model"] == name and choice["text"] == want_text
            assert choice["logprobs"]["tokens"] == [text(t) for t in want_ids], name
    assert expected[0] != expected[1]  # the two models differ, so a request sent to the wrong one would show


def test_models_lists_both_and_an_unknown_model_is_not_found(service, model_dirs):
    http, _ = service
    listed = httpx.get(f"{http}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["root"], m["max_model_len"]) for m in listed] == [(n, n, 256) for n in NAMES]  # no path on the server's disk
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/tokenize", {"prompt": "hi"})):
        r = httpx.post(f"{http}{path}", json={"model": "gamma", **body}, timeout=10)
        assert r.status_code == 404 and r.json()["error"] == {"message": "The model `gamma` does not exist.", "type": "invalid_request_error",
                                                              "param": "model", "code": "model_not_found"}, (path, r.text)
    counts = [httpx.post(f"{http}/tokenize", json={**m, "prompt": "Hello there"}, timeout=10).json()
              for m in ({"model": "beta"}, {})]  # without a model: the first
    assert counts[0]["count"] == counts[1]["count"] > 0 and counts[0]["max_model_len"] == 256


def test_metrics_say_which_model_and_every_pool_is_whole(service):
    http, coordinators = service
    before, _ = scrape(http)
    for name in NAMES:
        r = httpx.post(f"{http}/v1/completions", json={"model": name, "prompt": [3, 4], "max_tokens": 2, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
    after, _ = scrape(http)
    for name in NAMES:
        assert value(after, "pdserve_coordinator_up", model_name=name) == 1
        assert value(after, "pdserve_num_workers", model_name=name, role="colocated") == 1
        done = [value(s, "pdserve_request_success_total", model_name=name, finished_reason="length") for s in (before, after)]
        assert done[1] - done[0] == 1, name
    assert exposition_problems(httpx.get(f"{http}/metrics", timeout=10).text) == []
    for name, address in zip(NAMES, coordinators):
        with Client(address, timeout=10) as c:
            stats = wait_all_blocks_free(c)
            assert stats["model"] == name and [w["role"] for w in stats["workers"]] == ["colocated"]


def test_model_flags_name_each_model_once(model_dirs, tmp_path):
    """--model PATH=NAME splits at the last '=' unless the whole is a path; two models named alike stop the launch before anything starts."""
    from pdserve.cli import _model_and_name

    odd = tmp_path / "a=b"
    odd.mkdir()
    assert _model_and_name(f"{model_dirs[0]}=alpha") == (str(model_dirs[0]), "alpha")
    assert _model_and_name(str(odd)) == (str(odd), None) and _model_and_name(f"{odd}=x") == (str(odd), "x")
    done = subprocess.run([sys.executable, "-m", "pdserve", "launch", "--model", f"{model_dirs[0]}=same", "--model", f"{model_dirs[1]}=same",
                           "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "two models are named alike (same, same)" in done.stderr
