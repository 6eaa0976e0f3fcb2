"""The shared-prefix workloads of `pdserve bench`: `--prefix-len` (vLLM's prefix_repetition) and
the multi-turn chat replay, whose later turns resend the history with the answers; and the KV
hand-off bytes and prefix-cache hit rate the bench reports for a pdserve cluster, with and
without the prefix cache (real processes on loopback)."""
import json

from pdserve.bench.options import build_parser
from pdserve.bench.workloads import build_workload, chat_replay_requests, follow_up
from pdserve.common.tokenizer import load_tokenizer
from tests.bench.test_bench_serving import bench
from tests.helpers import start_cluster, wait_all_blocks_free


def test_prefix_len_and_chat_replay_workloads(model_dir):
    tok = load_tokenizer(str(model_dir))
    args = build_parser().parse_args(["--dataset-name", "prefix_repetition", "--prefix-len", "40", "--prefix-repetition-suffix-len", "8",
                                      "--prefix-repetition-num-prefixes", "2", "--num-prompts", "6"])
    reqs = build_workload(args, tok)
    assert len(reqs) == 6 and len({tuple(r.token_ids[:30]) for r in reqs}) == 2  # two shared prefixes
    convs = chat_replay_requests(tok, 9, 4, 24, 10, 8, seed=1)
    assert len(convs) == 2 and all(len(c.next_turns) == 3 for c in convs)
    assert convs[0].messages[0] == convs[1].messages[0] and convs[0].messages[0]["role"] == "system"  # one shared system prompt
    second = follow_up(tok, convs[0], "an answer")
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "user"] and len(second.next_turns) == 2
    assert second.token_ids[:len(convs[0].token_ids)] == convs[0].token_ids  # a later turn extends the earlier prompt


def replay_bytes(model_dir, tmp_path, *engine_args) -> dict:
    launcher = start_cluster(model_dir, tmp_path, engine_args=["--num-blocks", "512", *engine_args], coordinator_args=["--no-slo"])
    try:
        out = tmp_path / "r.json"
        stdout = bench("--backend", "pdserve", "--base-url", launcher.plan.client_addr, "--tokenizer", str(model_dir),
                       "--dataset-name", "chat_replay", "--num-prompts", "12", "--chat-turns", "4", "--prefix-len", "64",
                       "--input-len", "16", "--output-len", "16", "--ignore-eos", "--save-result", str(out))
        assert "KV hand-offs: 12," in stdout, stdout
        d = json.loads(out.read_text())
        assert d["completed"] == 12 and d["failed"] == 0
        from pdserve_client.library import Client

        with Client(launcher.plan.client_addr) as c:
            wait_all_blocks_free(c)
        return d
    finally:
        launcher.stop()


def test_chat_replay_moves_fewer_bytes_with_the_prefix_cache(model_dir, tmp_path):
    on = replay_bytes(model_dir, tmp_path / "on")
    off = replay_bytes(model_dir, tmp_path / "off", "--no-prefix-cache")
    assert off["prefix_cache_hits"] == 0 and on["prefix_cache_hits"] > 0
    assert on["input_lens"] == off["input_lens"]  # the same conversations (greedy: the same answers)
    print(f"chat replay KV hand-off bytes: {on['kv_handoff_bytes']} with the prefix cache, {off['kv_handoff_bytes']} without")
    assert on["kv_handoff_bytes"] <= off["kv_handoff_bytes"] / 2
