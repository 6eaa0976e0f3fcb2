"""`pdserve launch --ray` on a local multi-node Ray cluster (`ray.cluster_utils.Cluster` on
loopback: a head node without CPUs, two nodes of one CPU each), run as a user runs it (the CLI in
a subprocess), with the tiny random model, every role allowed down to zero and decode up to two:
the roles land on different nodes; removing a node with streams in flight leaves every stream
completed identically (or ended with a typed error), none hung, and the lost worker back on the
remaining node within 60 s; idleness takes every worker away (ready all the same: cold starts
on), a request whose TTFT target is under the cold start waits for it and is served identically,
while one more, past the held-requests bound, is refused 503 `cold_start` with Retry-After the
expected cold start (measured, once one was); a burst that queues then scales decode from one to two; a scale-down under load drains the worker it removes while
a request is in flight there (nothing placed on it once its drain starts, that request completes there identically,
nothing placed again). The launch serves a
second tiny model (`beta`, another seed) behind the same gateway, under the same limits: idle since the launch, it is
at zero workers, and its next request is served after a cold start; both models answer through the gateway as the
in-process runtime does on each. One cluster and one launch for the module; skipped where ray is not installed (the
`ray` extra)."""
import asyncio
import importlib.util
import json
import math
import threading

import httpx
import pytest

from pdserve.common.tokenizer import load_tokenizer
from pdserve.gateway.format import TokenText
from pdserve.launch import PORTS_PER_MODEL, port_plus
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.library import AsyncClient, Client
from pdserve_client.params import SamplingParams
from tests.faults.test_supervised_launch import Node, poll
from tests.faults.test_worker_death import check_outcomes, prompts, run_and_kill
from tests.helpers import save_tiny_served_model, wait_all_blocks_free

# the fixtures' setups (a 3-node cluster, the launch, the greedy reference) measured 70-113 s on 2 loaded cores: over the suite's 60 s
pytestmark = [pytest.mark.ray, pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (pip install 'pdserve[ray]')"),
              pytest.mark.timeout(300)]

MAX_TOKENS = 150  # each stream; run_and_kill (tests/faults/test_worker_death.py) starts 8
OBJECT_STORE = 80 * 2**20  # per node: Ray's smallest, the workers pass nothing through it
NODE = dict(num_cpus=1, object_store_memory=OBJECT_STORE)  # (Ray binds its own ports on the node address it finds)
BURST_TOKENS = 400
MAX_SEQS = 2  # each worker's: three long requests split 2 + 1, so the scale-down drains a worker holding one
CONTEXT = 4096  # the model's
LONG_TOKENS = 3000  # the long requests': each outlasts the downscale delay (1,000 took under 10 s)
DOWNSCALE_S = 10.0  # the burst's tail (two or fewer in flight) and the three long requests' placement fit in it
COLD_START_S = 20.0
BETA, BETA_TOKENS = "beta", 16  # the second model's name, and its answer's length
# a lost node is declared dead after 3 missed 1 s health checks (Ray's default: 5 of 3 s)
FAST_FAILURE = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 1000}


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={**NODE, "num_cpus": 0, "include_dashboard": False, "_system_config": FAST_FAILURE})
    try:
        for _ in range(2):
            c.add_node(**NODE)
        c.wait_for_nodes()
        ray.init(address=c.address, namespace="pdserve", log_to_driver=False)  # to ask the actors where they run
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The fault tests' tiny model (tests/faults/conftest.py kill_model_dir's shape) with a 4,096-token context: room
    for requests that outlast the downscale delay."""
    d = tmp_path_factory.mktemp("served-ray")
    save_tiny_served_model(d, hidden_size=128, intermediate_size=256, num_hidden_layers=4, max_position_embeddings=CONTEXT)
    return d


@pytest.fixture(scope="module")
def beta_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp(BETA)
    save_tiny_served_model(d, seed=1)
    return d


def greedy(model_dir, n: int, max_tokens: int) -> list[list[int]]:
    """The in-process runtime's greedy token ids for prompts(n) on that model."""
    eng = LLMEngine.load(str(model_dir), EngineConfig(num_blocks=1024), progress=False, tokenizer=False)
    return [c.token_ids for c in eng.generate(prompts(n), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))]


@pytest.fixture(scope="module")
def expected(model_dir):
    """Greedy tokens of prompts(8) on model_dir, MAX_TOKENS each."""
    return greedy(model_dir, 8, MAX_TOKENS)


@pytest.fixture(scope="module")
def long_expected(model_dir):
    """Greedy tokens of prompts(8)'s first MAX_SEQS + 1, LONG_TOKENS each."""
    return greedy(model_dir, MAX_SEQS + 1, LONG_TOKENS)


@pytest.fixture(scope="module")
def node(cluster, model_dir, beta_dir, tmp_path_factory):
    # 1/8 CPU a worker: the one node left after a loss holds both models' workers (up to 3 + 2)
    n = Node(model_dir, tmp_path_factory.mktemp("ray"), "--model", f"{beta_dir}={BETA}", "--ray", cluster.address,
             "--ray-num-cpus", "0.125", "--min-replicas", "0", "--max-replicas", "decode=2", "--downscale-delay-s", str(DOWNSCALE_S),
             "--cold-start-s", str(COLD_START_S),
             "--max-held-requests", "1", "--ttft-p99-ms", "60000", "--class-target", "1:1000:500", "--max-client-priority", "1",
             "--engine-arg=--kv-cache-mb=16", f"--engine-arg=--max-num-seqs={MAX_SEQS}")
    try:
        n.wait_workers(2)
        yield n
    finally:
        assert n.stop() == 0, n.stderr()


def placement(node) -> dict:
    """worker id -> the Ray node id its actor runs on, for the workers registered now."""
    import ray

    with Client(node.clients, timeout=5) as c:
        workers = {w["id"]: w["role"] for w in c.stats()["workers"]}
    out = {}
    for name in ray.util.list_named_actors():
        if name.startswith(node.workers + "/"):
            try:
                where = json.loads(ray.get(ray.get_actor(name).where.remote(), timeout=10))
            except (ValueError, ray.exceptions.RayError):  # removed meanwhile, or restarting after its node was lost
                continue
            wid = next((w for w in workers if w.startswith(name.rsplit("/", 1)[1] + "-")), None)
            if wid is not None:
                out[wid] = where["node_id"]
    return out


def warm(node, expected) -> None:
    """A request served (after a cold start if the workers were idle away), so that both roles run."""
    with Client(node.clients, timeout=120) as c:
        assert c.generate(token_ids=prompts(1)[0], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids == expected[0]
    poll("a prefill and a decode worker", lambda: {"prefill", "decode"} <= roles(node), 60)


def roles(node) -> set[str]:
    with Client(node.clients, timeout=5) as c:
        return {w["role"] for w in c.stats()["workers"]}


def test_roles_land_on_different_nodes(node, cluster):
    where = placement(node)
    assert len(where) == 2, where
    workers = {n.node_id for n in cluster.worker_nodes}
    assert set(where.values()) == workers, (where, workers)  # one on each node (SPREAD), none on the CPU-less head


def test_losing_a_node_mid_stream_every_stream_completes_or_fails_typed(node, cluster, expected):
    warm(node, expected)
    decode_node = {}

    def remove_decode_node():
        where = placement(node)
        victim = next(nid for wid, nid in where.items() if "-decode-" in wid)
        decode_node["id"] = victim
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == victim), allow_graceful=False)

    try:
        outs = asyncio.run(run_and_kill(node.clients, remove_decode_node, 80, max_tokens=MAX_TOKENS, timeout=120))
        completed = check_outcomes(outs, expected, 90)
        assert completed >= 1, outs
        survivor = next(n.node_id for n in cluster.worker_nodes)
        poll("a decode worker back on the remaining node", lambda: survivor in {nid for wid, nid in placement(node).items() if "-decode-" in wid}, 60)
        with Client(node.clients, timeout=60) as c:
            assert c.generate(token_ids=prompts(2)[1], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids == expected[1]
            wait_all_blocks_free(c, timeout=5)
    finally:
        cluster.add_node(**NODE)  # the next tests have two nodes again
        cluster.wait_for_nodes()


def test_idle_scales_to_zero_then_a_request_waits_for_a_cold_start(node, expected, model_dir):
    poll("no worker left", lambda: not roles(node), DOWNSCALE_S * 3 + 30)
    assert httpx.get(f"{node.http}/health/ready", timeout=10).status_code == 200  # at zero with cold starts on: ready
    results = []

    def held():  # class 1's TTFT target (1 s) is under the cold start: it waits all the same, its target counted from the registration
        with Client(node.clients, timeout=120) as c:
            results.append(c.generate(token_ids=prompts(1)[0], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, priority=1))

    t = threading.Thread(target=held)
    t.start()
    try:
        with Client(node.clients, timeout=10) as c:
            poll("a request held for the cold start", lambda: c.stats()["cold_start"]["held"] == 1, 30)
            expected_s = c.stats()["cold_start"]["expected_s"]
        # the held-requests bound (--max-held-requests 1) is full: refused, Retry-After the expected cold start
        r = httpx.post(f"{node.http}/v1/completions", json={"model": model_dir.name, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "cold_start", r.text
        assert int(r.headers["retry-after"]) == math.ceil(expected_s)
    finally:
        t.join(150)
    [got] = results
    assert got.token_ids == expected[0]
    with Client(node.clients, timeout=10) as c:
        cold = c.stats()["cold_start"]
    assert cold["measured"] >= 1 and cold["to_first_token_s"], cold
    # answered within the measured cold start and its TTFT target (1 s), with room for 2 loaded cores
    assert got.ttft <= cold["to_registered_s"][-1] + 10.0, (got.ttft, cold)
    print(f"cold start measured: {cold}")


def decode_count(node) -> int:
    with Client(node.clients, timeout=5) as c:
        return sum(w["role"] == "decode" for w in c.stats()["workers"])


def test_a_burst_scales_decode_up_and_the_scale_down_under_load_drains_the_worker_it_removes(node, expected, long_expected):
    """A burst brings decode to two workers (every burst request completes). Then three long requests, placed one at a
    time (stats show where each went): max_num_seqs 2 splits them 2 + 1; one of the pair is aborted, leaving one in flight
    on each worker, which one worker's room holds: the role is spare under load, and the worker drained (the newest of
    the two equally busy) holds a request. Its drain: nothing placed on it from then on (`placed_since` 0 in the launch's
    log, the coordinator's count), its request completes there identically (its Final names that worker), it is
    stopped once nothing is in flight; none is placed again (retries and workers_lost unchanged), the pools whole."""
    # a decode worker up (idle since the fixture, the roles may be at zero: the burst must not meet a cold start); not
    # warm(): a decode worker prefills locally, so the prefill role may stay at zero (it did, under load)
    with Client(node.clients, timeout=120) as c:
        assert c.generate(token_ids=prompts(1)[0], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids == expected[0]
    poll("a decode worker", lambda: decode_count(node) >= 1, 60)
    with Client(node.clients, timeout=10) as c:
        before = c.stats()["requests"]
    log_from = len(node.stderr())

    async def burst():
        async with AsyncClient(node.clients, timeout=180) as c:
            return await asyncio.gather(*(c.generate(token_ids=p, temperature=0, max_tokens=BURST_TOKENS, ignore_eos=True)
                                          for p in prompts(8)))

    burst_done = []
    b = threading.Thread(target=lambda: burst_done.append(asyncio.run(burst())))
    b.start()
    poll("two decode workers during the burst", lambda: decode_count(node) >= 2, 120)
    b.join(180)
    assert burst_done and [r.completion_tokens for r in burst_done[0]] == [BURST_TOKENS] * 8
    # the long requests, each placed before the next is sent (within the downscale delay of the burst's end: the role
    # is not spare while three are in flight); one of the pair aborted by its own client (another's abort is ignored)
    where = {}

    async def long_requests():
        async with AsyncClient(node.clients, timeout=180) as c:
            async def inflight():
                return {w["id"]: w["inflight"] for w in (await c.stats())["workers"] if w["role"] == "decode"}

            tasks = []
            for i in range(MAX_SEQS + 1):
                seen = await inflight()
                tasks.append(asyncio.create_task(c.generate(token_ids=prompts(8)[i], temperature=0, max_tokens=LONG_TOKENS,
                                                            ignore_eos=True, request_id=f"long-{i}")))
                for _ in range(200):
                    now = await inflight()
                    if sum(now.values()) == i + 1:
                        break
                    await asyncio.sleep(0.1)
                [where[i]] = [w for w in now if now[w] > seen.get(w, 0)]
            pair = next(w for w in set(where.values()) if list(where.values()).count(w) == MAX_SEQS)
            dropped = max(i for i in where if where[i] == pair)
            await c.abort(f"long-{dropped}")
            return dropped, await asyncio.gather(*tasks, return_exceptions=True)

    dropped, results = asyncio.run(long_requests())
    removed = poll("a decode worker drained and removed with a request in flight",
                   lambda: [ln for ln in node.stderr()[log_from:].splitlines() if "removing decode worker ray" in ln],  # not beta's
                   DOWNSCALE_S * 3 + 60)
    log = node.stderr()[log_from:]
    wid = removed[0].split("removing decode worker ")[1].split(":")[0]
    assert f"draining decode worker {wid} to remove it" in log and "0 placed on it since" in removed[0], removed
    inflight = int(removed[0].split("the ")[1].split(" requests in flight at its start completed")[0])
    kept = [i for i in where if i != dropped]
    assert isinstance(results[dropped], Exception) or results[dropped].completion_tokens < LONG_TOKENS, results[dropped]
    seen = [r if isinstance(r, Exception) else (r.latency, r.completion_tokens, r.decode_worker) for r in results]
    assert inflight == 1 and wid in {where[i] for i in kept}, (removed, where, seen)
    for i in kept:  # the drained worker's request among them: completed there, identically
        assert results[i].completion_tokens == LONG_TOKENS and results[i].token_ids == long_expected[i], i
        assert results[i].decode_worker == where[i], (i, results[i].decode_worker, where)
    with Client(node.clients, timeout=60) as c:
        assert c.generate(token_ids=prompts(2)[1], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids == expected[1]
        after = wait_all_blocks_free(c, timeout=5)["requests"]
    assert after.get("retries", 0) == before.get("retries", 0) and after.get("workers_lost", 0) == before.get("workers_lost", 0), after
    assert after["drains"] >= before.get("drains", 0) + 1 and after["workers_removed"] >= before.get("workers_removed", 0) + 1
    print(f"scale-down under load: {removed[0]}; long requests on {where}, long-{dropped} aborted; "
          f"their latencies {[round(r.latency, 1) for r in results if not isinstance(r, Exception)]} s")


def test_a_second_model_idle_at_zero_answers_after_its_cold_start(node, model_dir, beta_dir, expected):
    """beta (min 0 as every model here) has been idle since the launch: no worker; its request waits for a cold start."""
    beta = port_plus(node.clients, PORTS_PER_MODEL)
    with Client(beta, timeout=10) as c:
        poll("beta at zero workers", lambda: not c.stats()["workers"], DOWNSCALE_S * 3 + 30)
    want = greedy(beta_dir, 1, BETA_TOKENS)[0]
    assert want != expected[0][:BETA_TOKENS]  # the models differ: an answer from the wrong one would show
    text = TokenText(load_tokenizer(str(model_dir)))  # both models have the default model's tokenizer
    for name, ids in ((model_dir.name, expected[0]), (BETA, want)):  # the first while the burst's workers are up
        r = httpx.post(f"{node.http}/v1/completions", json={"model": name, "prompt": prompts(1)[0], "max_tokens": len(ids),
                                                            "temperature": 0, "ignore_eos": True, "logprobs": 0}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name and r.json()["choices"][0]["logprobs"]["tokens"] == [text(t) for t in ids], name
    with Client(beta, timeout=10) as c:
        stats = wait_all_blocks_free(c, timeout=5)
        assert stats["requests"]["cold_start_waits"] >= 1 and stats["workers"], stats["requests"]
        assert all(w["id"].startswith("model1-ray") for w in stats["workers"]), stats["workers"]  # beta's actors, not alpha's
    with Client(node.clients, timeout=10) as c:
        wait_all_blocks_free(c, timeout=5)
