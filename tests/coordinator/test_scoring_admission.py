"""Admission gives a scoring request (prompt_logprobs) no prefix-cache credit (issue 38): it
computes every prompt row (runtime/scoring.py), so the backlog, the blocks it reserves and its
prediction count its whole prompt, and it never waits for a twin to fill the cache it does not
use. In one process with the sends recorded (tests/coordinator/recorded.py)."""

from pdserve.coordinator.server import CoordinatorConfig
from pdserve.wire.protocol import PROTOCOL_VERSION, Admit, Generate, Hello, PromptLogprobs, Role
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import GenerateRequest
from tests.coordinator.recorded import Recorded
from tests.helpers import free_port

PROMPT = list(range(100, 164))  # 4 blocks of 16: 3 full ones before its last token
SCORING = SamplingParams(max_tokens=1, prompt_logprobs=1)


def coordinator(roles, **cfg) -> Recorded:
    c = Recorded(CoordinatorConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", slo=False, **cfg))
    for wid, role in roles:
        c.on_worker(wid.encode(), Hello(PROTOCOL_VERSION, wid, int(role), 1, "h", "b", "m", 2048, 64, 16,
                                        kv_endpoint="tcp://127.0.0.1:1", engine={"prefix_cache": 1}))
    return c


def start(c: Recorded, rid: str, params: SamplingParams) -> str:
    c.start_request(b"client", GenerateRequest(rid, params, token_ids=PROMPT), list(PROMPT))
    return c.by_client[(b"client", rid)]


def test_a_scoring_request_computes_its_whole_prompt_where_a_plain_one_finds_it_cached(closing):
    c = coordinator([("d", Role.DECODE)], paths="local", local_prefill_tokens=4096)
    closing(c)
    start(c, "first", SamplingParams(max_tokens=4))  # its placement notes the prefix on d
    again = c.requests[start(c, "again", SamplingParams(max_tokens=4))]
    scoring = c.requests[start(c, "score", SCORING)]
    assert (again.backlog, again.reserved) == (16, 1)  # 3 cached blocks: the last one to compute
    assert (scoring.backlog, scoring.reserved) == (64, 4)  # none: every row is computed and scored
    assert len(c.taken(Generate)) == 3


def test_a_scoring_twin_does_not_wait_for_a_cache_it_cannot_use(closing):
    c = coordinator([("p", Role.PREFILL), ("d", Role.DECODE)], paths="remote")
    closing(c)
    lead = start(c, "lead", SamplingParams(max_tokens=4))
    scoring = c.requests[start(c, "score", SCORING)]
    plain = c.requests[start(c, "plain", SamplingParams(max_tokens=4))]
    admitted = [m.request_id for _, m in c.taken(Admit)]
    assert admitted == [lead, scoring.iid] and plain.iid in c.pending  # the plain twin waits for the lead's blocks
    assert scoring.backlog == 64 and c.taken(Admit)[1][1].prefix_token_ids == []  # no cached blocks asked of d either


def test_scored_prompts_and_their_tokens_are_counted(closing):
    c = coordinator([("d", Role.DECODE)], paths="local")
    closing(c)
    iid = start(c, "score", SCORING)
    c.on_worker(b"d", PromptLogprobs(iid, [(-1.0, 1, [])] * (len(PROMPT) - 1)))
    c.on_worker(b"d", PromptLogprobs(iid, [(-1.0, 1, [])] * (len(PROMPT) - 1)))  # a second copy is dropped
    counts = c.stats()["requests"]
    assert (counts["scored_prompts"], counts["scored_prompt_tokens"]) == (1, len(PROMPT))
