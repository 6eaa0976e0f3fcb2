"""The gateway's request checks without processes: bodies decode to typed requests (a wrong type
names its field), prompts of every OpenAI form become coordinator inputs, chat messages and
sampling fields map as OpenAI defines them, and n > 1 fans out with seed + i."""
import json

import pytest

from pdserve.common.model_path import default_model_path
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.schema import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_jobs,
    completion_inputs,
    completion_jobs,
    decode_body,
)
from pdserve.gateway.server import served_name
from pdserve_client.errors import InvalidRequestError
from pdserve_client.protocol import ChatMessage


def chat(messages=({"role": "user", "content": "hi"},), **fields) -> ChatCompletionRequest:
    return decode_body(json.dumps({"model": "m", "messages": list(messages), **fields}).encode(), ChatCompletionRequest)


def test_served_names(tmp_path):
    assert served_name(None) == "SmolLM2-135M-Instruct" and default_model_path().name.startswith("SmolLM2-135M-Instruct.")
    assert served_name(str(tmp_path)) == tmp_path.name
    for file, name in (("Llama-3.2-1B-Instruct.Q4_K_M.gguf", "Llama-3.2-1B-Instruct"), ("tiny-f16.gguf", "tiny"), ("plain.gguf", "plain")):
        (tmp_path / file).touch()
        assert served_name(str(tmp_path / file)) == name


def test_config_is_validated():
    with pytest.raises(InvalidRequestError, match="port"):
        GatewayConfig(port=70000)
    with pytest.raises(InvalidRequestError, match="api_key"):
        GatewayConfig(api_key="")


def test_bodies_decode_or_name_the_bad_field():
    req = decode_body(b'{"model": "m", "prompt": [1, 2], "stop": "x", "unknown_field": 1}', CompletionRequest)
    assert req.prompt == [1, 2] and req.stop == "x" and req.n == 1 and req.max_tokens is None
    with pytest.raises(ApiError) as e:
        decode_body(b'{"model": "m", "prompt": "p", "temperature": "hot"}', CompletionRequest)
    assert (e.value.status, e.value.param) == (400, "temperature")
    with pytest.raises(ApiError) as e:
        decode_body(b'{"model": "m"}', CompletionRequest)
    assert e.value.status == 400 and "prompt" in e.value.message
    with pytest.raises(ApiError, match="not valid JSON"):
        decode_body(b"{", CompletionRequest)


def test_prompt_forms():
    assert completion_inputs("hi", 100) == [{"prompt": "hi"}]
    assert completion_inputs(["a", "b"], 100) == [{"prompt": "a"}, {"prompt": "b"}]
    assert completion_inputs([1, 2, 3], 100) == [{"token_ids": [1, 2, 3]}]
    assert completion_inputs([[1], [2, 3]], 100) == [{"token_ids": [1]}, {"token_ids": [2, 3]}]
    for bad in ([], [1, "a"], [True, 2], [1, 100], [-1], [[1], []], [[1], "a"]):
        with pytest.raises(ApiError) as e:
            completion_inputs(bad, 100)
        assert (e.value.status, e.value.param) == (400, "prompt"), bad


def test_completion_sampling_defaults_and_fan_out():
    [job] = completion_jobs(CompletionRequest(model="m", prompt="p"), 100)
    assert job.sampling["max_tokens"] == 16 and "temperature" not in job.sampling  # SamplingParams' default: 1.0, as OpenAI
    jobs = completion_jobs(CompletionRequest(model="m", prompt=["a", "b"], n=2, seed=5, stop="x", logprobs=2, top_k=3), 100)
    assert [(j.index, j.prompt_index, j.inputs["prompt"], j.sampling["seed"]) for j in jobs] == [
        (0, 0, "a", 5), (1, 0, "a", 6), (2, 1, "b", 5), (3, 1, "b", 6)]
    assert jobs[0].sampling["stop"] == ["x"] and jobs[0].sampling["logprobs"] == 2 and jobs[0].sampling["top_k"] == 3
    for bad, param in ((dict(n=0), "n"), (dict(suffix="s"), "suffix"), (dict(temperature=-1.0), "temperature"),
                       (dict(prompt_logprobs=21), "prompt_logprobs"),
                       (dict(logit_bias={"1": 2.0}), "logit_bias"), (dict(max_tokens=0), "max_tokens")):
        with pytest.raises(ApiError) as e:
            completion_jobs(CompletionRequest(model="m", prompt="p", **bad), 100)
        assert (e.value.status, e.value.param) == (400, param)


def test_echo_and_prompt_logprobs_mapping():
    """echo with logprobs asks the prompt's logprobs with the same k; max_tokens 0 (echo only) samples one token to drop."""
    [job] = completion_jobs(CompletionRequest(model="m", prompt="p", echo=True, logprobs=1, max_tokens=0), 100)
    assert job.sampling["prompt_logprobs"] == 1 and job.sampling["max_tokens"] == 1 and job.sampling["logprobs"] == 1
    [job] = completion_jobs(CompletionRequest(model="m", prompt="p", echo=True, logprobs=1, prompt_logprobs=5), 100)
    assert job.sampling["prompt_logprobs"] == 5 and job.sampling["max_tokens"] == 16
    [job] = completion_jobs(CompletionRequest(model="m", prompt="p", logprobs=3), 100)
    assert "prompt_logprobs" not in job.sampling  # without echo the prompt is not scored
    [job] = completion_jobs(CompletionRequest(model="m", prompt="p", echo=True), 100)
    assert "prompt_logprobs" not in job.sampling  # echo without logprobs: only the text


def test_each_distinct_prompt_is_scored_by_one_choice_and_shared_by_the_others():
    jobs = completion_jobs(CompletionRequest(model="m", prompt=[[1, 2, 3], [4, 5], [1, 2, 3]], n=2, echo=True, max_tokens=0,
                                             prompt_logprobs=1), 100)
    assert [j.scores_from for j in jobs] == [None, 0, None, 2, 0, 0]
    assert [j.sampling.get("prompt_logprobs") for j in jobs] == [1, None, 1, None, None, None]
    assert all(j.sampling["max_tokens"] == 1 for j in jobs)  # nothing else of the choices changes
    [a, b] = completion_jobs(CompletionRequest(model="m", prompt=["x", "x"], echo=True, logprobs=2), 100)
    assert (a.sampling["prompt_logprobs"], b.scores_from, "prompt_logprobs" in b.sampling) == (2, 0, False)  # echo's logprobs score too
    plain = completion_jobs(CompletionRequest(model="m", prompt="p", n=3), 100)
    assert [j.scores_from for j in plain] == [None] * 3 and not any("prompt_logprobs" in j.sampling for j in plain)


def test_chat_mapping():
    [job] = chat_jobs(chat(), 2048)
    assert job.sampling["max_tokens"] == 2048 and job.sampling["logprobs"] is None  # no limit: the rest of the context
    [job] = chat_jobs(chat(max_tokens=9, max_completion_tokens=5, logprobs=True, top_logprobs=4), 2048)
    assert job.sampling["max_tokens"] == 5 and job.sampling["logprobs"] == 4
    [job] = chat_jobs(chat(logprobs=True), 2048)
    assert job.sampling["logprobs"] == 0
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "user", "content": None}]
    [job] = chat_jobs(chat(msgs), 10)
    assert job.inputs["messages"] == [ChatMessage("system", "a\nb"), ChatMessage("user", "")]
    for bad, param in ((dict(top_logprobs=2), "top_logprobs"), (dict(messages=[]), "messages"), (dict(tools=[{"type": "function"}]), "tools"),
                       (dict(response_format={"type": "json_schema"}), "response_format")):
        with pytest.raises(ApiError) as e:
            chat_jobs(chat(**bad), 10)
        assert (e.value.status, e.value.param) == (400, param)
    with pytest.raises(ApiError, match="only text"):
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        chat_jobs(chat(image), 10)



def test_token_id_prompt_longer_than_the_context_is_refused_before_its_ids_are_checked():
    with pytest.raises(ApiError) as e:
        completion_inputs([1] * 3000, 100, 2048)
    assert e.value.status == 400 and e.value.code == "prompt_too_long"
    assert len(completion_inputs(["a"] * 3000, 100, 2048)) == 3000  # a batch of many short prompts is not a long prompt


def test_oversized_prompt_and_stop_are_refused_from_their_json_length():
    import json

    from pdserve.gateway.schema import refuse_oversized
    from pdserve.wire.limits import RequestLimits

    limits = RequestLimits(max_prompt_bytes=100, max_stop=2, max_stop_length=3)
    for body in ({"prompt": "a" * 700}, {"prompt": "hi", "stop": ["abc"] * 100}):
        with pytest.raises(ApiError) as e:
            refuse_oversized(json.dumps(body).encode(), limits)
        assert e.value.status == 400 and e.value.code == "limit_exceeded"
    for body in ({"prompt": "\x01" * 100}, {"prompt": ["a" * 700]}, {"stop": ["\x01\x01\x01"] * 2}):  # at the limit, or not one string
        refuse_oversized(json.dumps(body).encode(), limits)
