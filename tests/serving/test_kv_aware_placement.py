"""KV-aware placement with real processes: 2 prefill workers, 4 distinct shared prefixes sent
interleaved (A B C D, B C D A, ...): the coordinator sends each prefix back to the worker that
holds it, so >= 90% of the cacheable prompt tokens (prefix blocks seen before) hit, read from
`pdserve stats` (random placement would hit about half of them on the second round)."""
import asyncio
import json

import pytest

from pdserve_client.library import AsyncClient, Client
from tests.helpers import save_tiny_served_model, start_cluster, wait_all_blocks_free

BLOCK = 8
PREFIX_LEN = 64
ROUNDS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    return d


def prompt(prefix: int, round_: int) -> list[int]:
    return [1000 + 500 * prefix + (j * 7) % 400 for j in range(PREFIX_LEN)] + [9000 + 100 * round_ + 10 * prefix + j for j in range(9)]


async def rounds(address):
    async with AsyncClient(address, timeout=120) as c:
        for r in range(ROUNDS):  # each round sends the four prefixes at once, in a rotated order (load alone would misplace them)
            order = [(p + r) % 4 for p in range(4)]
            await asyncio.gather(*(c.generate(token_ids=prompt(p, r), max_tokens=4, temperature=0.0, ignore_eos=True) for p in order))


def test_two_prefill_workers_four_prefixes_hit_90_percent(model_dir, tmp_path):
    # --no-slo: placement by load and expected hit (with SLO control a tiny model's predicted step
    # times are noise, each worker's own fit, and may favour one worker throughout); --paths remote:
    # this is placement on prefill workers (these 73-token prompts would be prefilled locally)
    launcher = start_cluster(model_dir, tmp_path, prefill=2, decode=1, engine_args=["--num-blocks", "256", "--block-size", str(BLOCK)],
                             coordinator_args=["--no-slo", "--paths", "remote"])
    try:
        asyncio.run(rounds(launcher.plan.client_addr))
        with Client(launcher.plan.client_addr) as c:
            stats = wait_all_blocks_free(c)
        prefills = [w for w in stats["workers"] if w["role"] == "prefill"]
        hits = sum(w["prefix_cache"]["hits"] for w in prefills)
        cacheable = (ROUNDS - 1) * 4 * PREFIX_LEN  # every prefix's blocks, after its first time
        assert hits >= 0.9 * cacheable, json.dumps([w["prefix_cache"] for w in prefills])
        assert all(w["prefix_cache"]["cached_blocks"] > 0 for w in prefills)  # both used: load still counts
        assert stats["requests"].get("finished:length") == ROUNDS * 4
    finally:
        launcher.stop()
