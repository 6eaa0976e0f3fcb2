"""Hand-offs of a quantized KV cache (--kv-cache-dtype int8 / fp8, kernels.kv_quant): a prefill
engine's int8 blocks (uint8 pools), codes, scales and zero codes together, move through the real KVSender / KVReceiver
over shm (a shared /dev/shm pool) and tcp into an int8 decode pool byte for byte, a quarter of
the float bytes (D + 4 a row instead of 4 D), with both pools whole after; a decode worker fed
int8 blocks decodes the single-process int8 engine's tokens; a prefill worker whose pool stores
KV otherwise than the decode pool's is refused at the handshake, before a byte moves."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import kv_quant
from pdserve.kvtransfer.heads import block_bytes
from pdserve.kvtransfer.pool import KVPool
from pdserve.kvtransfer.transfer import KVDtypeMismatch, KVReceiver, KVSender
from pdserve.runtime.kv_cache import kv_cache_shape
from pdserve_client.params import SamplingParams
from tests.decode.test_worker import admit as admit_on
from tests.decode.test_worker import all_free, deliver, tokens_of, workers
from tests.helpers import tiny_engine
from tests.kvtransfer.test_gpu_backends import Pump, ctx, ready  # noqa: F401 (fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prefilled(tiny, kv: str):
    """A prefill engine (--kv-cache-dtype kv) holding one 21-token prompt: (engine, pool, its blocks)."""
    engine, pool = tiny_engine(tiny, prefill_only=True, kv_cache_dtype=kv)
    engine.add_request(list(range(3, 24)), GREEDY, request_id="r", hold=True)
    while engine.has_work():
        engine.step()
    return engine, pool, list(engine.seqs["r"].block_table)


@pytest.mark.parametrize("backend", ("shm", "tcp"))
def test_int8_blocks_and_scales_move_whole_through_shm_and_tcp(tiny, ctx, backend):  # noqa: F811
    engine, src, table = prefilled(tiny, "int8")
    assert src.dtype == kv_quant.INT8 and kv_quant.scales(src[:, :, table]).abs().sum() > 0, "the prompt's rows carry scales"
    dest_ids = [40 + 2 * i for i in range(len(table))]
    shape = kv_cache_shape(engine.cfg, 64, 8, kv_quant.INT8)
    shared = KVPool.create(shape, kv_quant.INT8, shared=backend == "shm")
    receiver = KVReceiver(ctx, shared.tensor, shm_path=shared.path)
    pump, sender = Pump(receiver), KVSender(ctx, "prefill-1", timeout=5, backend=backend)
    try:
        sender.send(src, table, ready("r", dest_ids, "?"), receiver.endpoint)
        msg, frames = pump.get()
        receiver.copy_in(msg, frames)
        dst = receiver.pool
        assert msg.backend == backend and torch.equal(dst[:, :, dest_ids], src[:, :, table])
        others = [b for b in range(64) if b not in dest_ids]
        assert not dst[:, :, others].any(), "a block outside the grant was written"
        d = engine.cfg.head_dim
        assert sender.bytes_sent == len(table) * block_bytes(src) == len(table) * block_bytes(torch.zeros(shape[:-1] + (d,))) * (d + 4) // (4 * d)
    finally:
        for x in (pump, sender, receiver):
            x.close()
        shared.close()
    engine.release("r")
    assert engine.blocks.free_blocks == engine.blocks.num_blocks and not engine.blocks.leaked()


def test_fp8_blocks_move_through_tcp(tiny, ctx):  # noqa: F811
    """tcp scatters with index_copy_, which torch lacks for float8: it copies the bytes instead."""
    engine, src, table = prefilled(tiny, "fp8")
    receiver = KVReceiver(ctx, torch.zeros(kv_cache_shape(engine.cfg, 64, 8, torch.float8_e4m3fn), dtype=torch.float8_e4m3fn))
    pump, sender = Pump(receiver), KVSender(ctx, "prefill-1", timeout=5, backend="tcp")
    try:
        sender.send(src, table, ready("r", [1, 2, 3], "?"), receiver.endpoint)
        receiver.copy_in(*pump.get())
        assert torch.equal(receiver.pool[:, :, [1, 2, 3]].view(torch.uint8), src[:, :, table].view(torch.uint8))
    finally:
        for x in (pump, sender, receiver):
            x.close()
    engine.release("r")
    assert engine.blocks.free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("prefill_kv,decode_kv", [("auto", "int8"), ("int8", "auto"), ("int8", "fp8")])
def test_a_kv_cache_dtype_mismatch_is_refused_at_the_handshake(tiny, ctx, prefill_kv, decode_kv):  # noqa: F811
    engine, src, table = prefilled(tiny, prefill_kv)
    dtype = kv_quant.storage_dtype(decode_kv, torch.float32)
    receiver = KVReceiver(ctx, torch.zeros(kv_cache_shape(engine.cfg, 64, 8, dtype), dtype=dtype))
    pump, sender = Pump(receiver), KVSender(ctx, "prefill-1", timeout=5, backend="tcp")
    try:
        with pytest.raises(KVDtypeMismatch, match="--kv-cache-dtype"):
            sender.send(src, table, ready("r", [1, 2, 3], "?"), receiver.endpoint)
        assert pump.out.empty() and not receiver.pool.view(torch.uint8).any() and sender.dests == {}
    finally:
        for x in (pump, sender, receiver):
            x.close()
    engine.release("r")


def test_int8_pools_of_a_build_before_the_rotated_rows_are_refused(tiny, ctx):  # noqa: F811
    """A decode pool of the symmetric int8 rows of builds before 2026-12-08 (torch.int8, D + 4 wide: the same
    width as this build's rows) is told from this build's uint8 rows by its dtype name, before a byte moves."""
    engine, src, table = prefilled(tiny, "int8")
    receiver = KVReceiver(ctx, torch.zeros(kv_cache_shape(engine.cfg, 64, 8, torch.uint8), dtype=torch.int8))
    assert receiver.pool.shape[-1] == src.shape[-1] and src.dtype == torch.uint8
    pump, sender = Pump(receiver), KVSender(ctx, "prefill-1", timeout=5, backend="tcp")
    try:
        with pytest.raises(KVDtypeMismatch, match="before 2026-12-08"):
            sender.send(src, table, ready("r", [1, 2, 3], "?"), receiver.endpoint)
        assert pump.out.empty() and not receiver.pool.view(torch.uint8).any()
    finally:
        for x in (pump, sender, receiver):
            x.close()
    engine.release("r")


def test_a_decode_worker_fed_int8_blocks_decodes_the_int8_engines_tokens(tiny):
    p, d, inbox = workers(tiny, kv_cache_dtype="int8")
    assert p.engine.runner.kv_cache.dtype == kv_quant.INT8 == d.engine.runner.kv_cache.dtype
    from pdserve.wire.protocol import Prefill

    prompts = {"a": list(range(3, 23)), "b": list(range(40, 45))}
    for rid, prompt in prompts.items():
        p.link.inbox.append(Prefill(rid, prompt, GREEDY, "decode-1", "local://decode-1", admit_on(d, rid, len(prompt))))
    while p.jobs or p.link.inbox:
        p.turn(0)
    deliver(d, inbox)
    while d.link.inbox or d.engine.has_work():
        d.turn(0)
    reference, _ = tiny_engine(tiny, kv_cache_dtype="int8")
    want = {rid: c.token_ids for rid, c in zip(prompts, reference.generate(list(prompts.values()), GREEDY))}
    assert tokens_of(d) == want
    assert all_free(p) and all_free(d) and not d.grants
