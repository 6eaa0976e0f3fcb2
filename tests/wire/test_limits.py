"""Request limits: an oversized GenerateRequest frame is refused from its msgpack lengths, before
the coordinator decodes it; frames within the limits (or other messages) are left to the decoder."""
from pdserve.wire.limits import RequestLimits
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import AbortRequest, ChatMessage, GenerateRequest, encode


def test_oversized_frames_are_found_without_decoding():
    limits = RequestLimits(max_prompt_bytes=1000, max_stop=2, max_stop_length=4)
    over = [GenerateRequest("a", SamplingParams(), prompt="x" * 1006),
            GenerateRequest("b", SamplingParams(stop=["abcd"] * 20), prompt="hi")]  # 101 bytes: over 2 x 4 chars of up to 4 bytes
    assert [limits.oversized_frame(encode(r))[0] for r in over] == ["a", "b"]
    within = [GenerateRequest("c", SamplingParams(stop=["\u00e9" * 4] * 2), prompt="\u00e9" * 500),  # 1000 bytes, 2 x 4 chars
              GenerateRequest("d", SamplingParams(), token_ids=list(range(5000))),
              GenerateRequest("e", SamplingParams(), messages=[ChatMessage("user", "x" * 5000)]),  # checked after decoding
              AbortRequest("f")]
    assert [limits.oversized_frame(encode(r)) for r in within] == [None] * 4
