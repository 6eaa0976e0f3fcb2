"""A worker whose KV blocks no registered worker could take or give (another model, block size
or KV dtype) is refused at registration; tensor parallel sizes may differ (blocks move whole)."""
from pdserve.coordinator.server import handoff_mismatch
from pdserve.wire.protocol import PROTOCOL_VERSION, Hello, Role


def hello(wid, role=Role.DECODE, model="m", block_size=16, dtype="float32", tp=1, kv="auto"):
    return Hello(PROTOCOL_VERSION, wid, int(role), 1, "h", "b", model, 2048, 64, block_size,
                 engine={"dtype": dtype, "tensor_parallel_size": tp, "kv_cache_dtype": kv})


def test_handoff_mismatch_refused_at_registration():
    registered = [hello("d", tp=1)]
    assert handoff_mismatch(hello("p", Role.PREFILL, tp=3), registered) is None
    assert handoff_mismatch(hello("d", block_size=32), registered) is None  # its own re-registration
    for bad, what in ((hello("p", model="other"), "model"), (hello("p", block_size=32), "block size"),
                      (hello("p", dtype="bfloat16"), "KV dtype"), (hello("p", kv="int8"), "KV cache dtype")):
        problem = handoff_mismatch(bad, registered)
        assert problem.startswith("not supported") and what in problem, problem


def test_fp8_and_fp8_e4m3_are_one_kv_cache_dtype():
    assert handoff_mismatch(hello("p", Role.PREFILL, kv="fp8"), [hello("d", kv="fp8_e4m3")]) is None
