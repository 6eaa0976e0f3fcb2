"""The gateway's OpenAPI document, fuzzed by schemathesis against the live gateway (a real
coordinator, a prefill and a decode worker running a tiny random-weight model): every generated
request to every route gets a 2xx or 4xx that is documented and matches its schema (never a 5xx),
within a timeout. Generated bodies keep their shape; a hook only caps what would make one request
long (max_tokens, n) and names the served model in most of them, so the run stays small: at most
MAX_EXAMPLES cases an operation. The last test checks that every operation ran and prints the
figures (cases per operation, seconds)."""
import time

import hypothesis
import pytest
import schemathesis
from schemathesis import checks as st_checks

from pdserve.gateway.openapi import openapi
from tests.gateway.helpers import start_gateway_cluster
from tests.helpers import save_tiny_served_model

MAX_EXAMPLES = 25  # an operation; 11 operations
CALL_TIMEOUT_S = 30  # one request may not take longer ("none hangs")
CHECKS = [st_checks.not_a_server_error, st_checks.status_code_conformance, st_checks.content_type_conformance,
          st_checks.response_schema_conformance]

schema = schemathesis.openapi.from_dict(openapi("pdserve", "test"))
served = {"model": None, "url": None}
tally: dict[str, int] = {}
statuses: dict = {}
started = time.monotonic()


TAME = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "logprobs", "top_logprobs",
        "add_special_tokens", "add_generation_prompt", "return_token_strs", "tokens", "input", "instructions", "max_output_tokens", "echo",
        "prompt_logprobs"}


@schema.hook
def map_body(context, body):
    """Cap the lengths a body asks for; name the served model in most bodies (the rest get a 404);
    keep only the plain fields of half the bodies (random sampling values are mostly refused, and
    the served path should be fuzzed too)."""
    if isinstance(body, dict):
        if len(body) % 2:
            body = {k: v for k, v in body.items() if k in TAME}
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 4:
                body[key] = 4
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
            body["n"] = 2
        if isinstance(body.get("model"), str) and len(body["model"]) % 4:
            body["model"] = served["model"]
    return body


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=256)  # a chat without max_tokens runs to the context's end
    launcher = start_gateway_cluster(d, tmp_path_factory.mktemp("logs"))
    served["model"], served["url"] = d.name, launcher.plan.http_url
    yield launcher
    launcher.stop()


@schema.parametrize()
@hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
def test_every_generated_request_gets_a_documented_answer(case, gateway):
    label = f"{case.operation.method.upper()} {case.operation.path}"  # schemathesis also sends other methods to a path (405)
    tally[label] = tally.get(label, 0) + 1
    r = case.call_and_validate(base_url=served["url"], checks=CHECKS, timeout=CALL_TIMEOUT_S)
    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1


def test_every_operation_was_fuzzed(gateway):
    operations = {f"{method.upper()} {path}" for path, item in schema.raw_schema["paths"].items() for method in item}
    assert set(tally) == operations, operations - set(tally)
    print(f"\nschemathesis: {sum(tally.values())} cases over {len(tally)} operations in {time.monotonic() - started:.0f} s: {tally}")
    print(f"statuses: {dict(sorted(statuses.items()))}")
    assert statuses.get(200, 0) > 0 and not [s for s in statuses if s >= 500]
