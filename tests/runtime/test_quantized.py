"""Quantized GGUF weights served as they are (kernels/quant.py, kernels/csrc/quant_ops.c).

- The C dequantizer equals the torch twin, which equals the gguf package's, bit for bit.
- The matmul paths (float activations: direct for <= 4 rows, tiled up to 128, dequantize + MKL
  above) equal the float twin (dequantize, F.linear) to float32 summation order: max error
  <= 1e-5 of the output's largest magnitude. The int16 and int8 activation paths (<= 4 rows)
  equal their own twin (kernels.quant.matmul_int_twin, float64) to the same bound, and int16
  stays within 1e-4 of the float path. Each runs on every instruction-set variant the machine
  runs (tests/kernels/variants.py): the avx512 one's int16 GEMM (vpdpwssd) and the baseline's
  plain C compute the same integer products as the avx2 one.
- A tiny random Llama written as Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 GGUF decodes greedily like its float twin
  (the same file loaded with quantization none), keeps its matrices quantized, and its
  weights take about the quantization ratio of the float bytes.
- The one-call decode step (kernels/csrc/step_ops.c) equals the per-op layer loop it replaces
  bit for bit (logits and KV cache), with and without a qkv bias, at direct and tiled row counts,
  and with sliding windows of different widths on its layers.
- The default model, teacher-forced over the 54 shipped prompts against the float twin
  (the issue's goals: top-1 agreement >= 99%, mean KL <= 0.01): the quantized prefill path and
  the default int16-activation decode path at 4 rows meet them; the opt-in int8-activation
  decode path is held to looser bounds (figures printed).
"""
import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pdserve.common.tokenizer import render_chat
from pdserve.kernels import backends, cpu_native, kv_quant
from pdserve.kernels.quant import DIRECT_INT_ROWS, K_QTYPES, QTYPES, QuantTensor, block_weights, matmul, matmul_int_twin, matmul_twin
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine, load_model
from pdserve.runtime.kv_cache import allocate_kv_cache
from pdserve.runtime.model import ForwardBatch
from pdserve_client.params import SamplingParams
from tests.helpers import quant_blocks, save_tiny_model, write_gguf
from tests.kernels.variants import isa  # noqa: F401  (the fixture: a test taking it runs on every instruction-set variant)

pytestmark = pytest.mark.skipif(cpu_native.native() is None, reason="needs a C compiler for the quantized kernels")
BLOCK32 = [q for q in QTYPES if q not in K_QTYPES]  # the 32-weight types (the K-quants: tests/kernels/test_kquant.py, test_kquant_model.py)


def random_quant(qtype: str, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    """Random blocks (tests.helpers.quant_blocks); a K-quant's width rounded up to whole super-blocks."""
    return quant_blocks(qtype, rows, -(-cols // block_weights(qtype)) * block_weights(qtype), seed)


@pytest.mark.parametrize("qtype", BLOCK32)
def test_dequantize_c_equals_twin_equals_gguf(qtype, isa):  # noqa: F811
    w = random_quant(qtype, 40, 96)
    ref = torch.from_numpy(gguf.quants.dequantize(w.raw.numpy(), gguf.GGMLQuantizationType[qtype]).reshape(40, 96).astype(np.float32))
    assert torch.equal(w.dequantize(), ref)
    assert torch.equal(cpu_native.native().q_dequant(w), ref)
    rows = torch.tensor([3, 0, 39, 3])
    assert torch.equal(w.rows_float(rows), ref[rows])


@pytest.mark.parametrize("qtype", BLOCK32)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 33, 45, 128, 131])
def test_matmul_paths_equal_their_twins(qtype, rows, isa):  # noqa: F811
    # 53: float tile (24) and register-block (3) tails, int16 panel (48) and micro-tile (4) tails;
    # rows 8, 33, 45, 131: last int16 tiles of 8, 1, 13, 3 rows
    w = random_quant(qtype, 53, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(53)
    got, ref = matmul(x, w, bias), matmul_twin(x, w, bias)
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    strided = torch.randn(rows, 200)[:, :160]  # rows with a stride wider than K
    assert torch.allclose(matmul(strided, w), matmul_twin(strided, w), rtol=0, atol=1e-5 * float(matmul_twin(strided, w).abs().max()))
    for kind in ("int8", "int16"):
        got_int = matmul(x, w, activations=kind)
        if rows > DIRECT_INT_ROWS[kind]:  # int8 takes small decode batches; larger ones stay float (int16: every size)
            assert torch.equal(got_int, matmul(x, w))
            continue
        got = matmul(x, w)
        ref_int = matmul_int_twin(x, w, kind)
        assert float((got_int.double() - ref_int).abs().max()) <= 1e-5 * float(ref_int.abs().max())
        assert not torch.equal(got_int, got)  # the integer path does round the activations
        # int16's rounding is far finer than int8's: within 1e-4 of the float path's largest value
        plain = matmul_twin(x, w)
        err = float((got_int - plain).abs().max()) / float(plain.abs().max())
        assert err <= (1e-4 if kind == "int16" else 3e-2), (kind, err)


@pytest.mark.parametrize("qtype", BLOCK32)
def test_int8_vnni_gemm_equals_its_twin_and_runs_only_where_built(qtype, isa):  # noqa: F811
    """pd_q_gemm_i8 (vpdpbusd, activations offset by 128, the weight sums' correction): only the
    avx512 variant builds it; elsewhere the c-int8-vnni back-end does not bind, so the selector
    never offers it. Where built it equals matmul_int_twin "int8" at row counts with ragged
    tiles (32 rows a tile, 16 a vector), over 101 weight rows (panels of 48, micro-tiles of 6:
    ragged both), with a zero block, a row's extremes and, in Q8_0, the code -128."""
    w = random_quant(qtype, 101, 192, seed=7)
    if qtype == "Q8_0":
        w.raw[::3, 2] = 0x80  # code -128 (the int8 range's end; gguf writes -127..127)
    bound = backends.BY_NAME["c-int8-vnni"].bind(w)
    assert (cpu_native.native().q_linear_i8_gemm(w) is None) == (bound is None) == (isa != "avx512")
    if bound is None:
        return
    g = torch.Generator().manual_seed(11)
    for rows in (1, 4, 15, 16, 17, 33, 64, 130):
        x = torch.randn(rows, 256, generator=g)[:, :192]  # rows strided wider than K
        x[0, 32:64] = 0.0
        x[-1, 5] = 40.0
        got, ref = bound(x), matmul_int_twin(x, w, "int8")
        assert float((got.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), rows
    few = torch.randn(3, 192, generator=g)  # the direct int8 path rounds the same way
    assert torch.allclose(bound(few), matmul(few, w, activations="int8"), rtol=0, atol=1e-5 * float(matmul(few, w).abs().max()))


@pytest.mark.parametrize("qtype", BLOCK32)
def test_tiny_quantized_gguf_decodes_like_its_float_twin(tmp_path, qtype):
    save_tiny_model(tmp_path / "hf", arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    write_gguf(tmp_path / "m.gguf", tmp_path / "hf", qtype)
    cfg = EngineConfig(num_blocks=64, block_size=8)
    quant = LLMEngine.load(tmp_path / "m.gguf", cfg, progress=False, tokenizer=False)
    twin = LLMEngine.load(tmp_path / "m.gguf", EngineConfig(num_blocks=64, block_size=8, quantization="none"), progress=False, tokenizer=False)
    assert quant.model.quantized and not twin.model.quantized
    assert {q.qtype for q in quant.model.quantized.values()} == {qtype}
    ratio = QTYPES[qtype][1] / (32 * 4)
    linear = sum(p.numel() * 4 for n, p in twin.model.named_parameters() if n in quant.model.quantized)
    assert quant.model.weight_bytes() <= twin.model.weight_bytes() - linear * (1 - ratio) + 1024
    # the module forward (QuantLinear: the Triton kernel on CUDA, dequantize + F.linear here) is
    # the float twin's, bit for bit
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 12)]
    tables = torch.arange(2, dtype=torch.int32).reshape(2, 1)
    kv_q, kv_t = (allocate_kv_cache(m.model.cfg, 2, 16, torch.float32) for m in (quant, twin))
    batch = _forward_batch(seqs, [0, 0], tables, 16)
    assert torch.equal(quant.model.forward_modules(batch, kv_q), twin.model.forward_modules(batch, kv_t))
    prompts = [[5, 9, 12, 30, 7], list(range(3, 40)), [17]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for batch in ([p] for p in prompts):
        assert quant.generate(batch, params)[0].token_ids == twin.generate(batch, params)[0].token_ids
    together = [c.token_ids for c in quant.generate(prompts, params)]
    assert together == [c.token_ids for c in twin.generate(prompts, params)]
    assert quant.blocks.free_blocks == quant.blocks.num_blocks


def _forward_batch(seqs: list[list[int]], starts: list[int], tables: torch.Tensor, block: int, logits_last: bool = True) -> ForwardBatch:
    """Tokens starts[i].. of each sequence, its pages in tables[i]; logits of each last row."""
    ids, pos, slots, qsl = [], [], [], [0]
    for i, s in enumerate(seqs):
        p = torch.arange(starts[i], len(s))
        ids.append(torch.tensor(s[starts[i]:]))
        pos.append(p)
        slots.append(tables[i, p // block].long() * block + p % block)
        qsl.append(qsl[-1] + len(p))
    q = torch.tensor(qsl, dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.cat(ids), positions=torch.cat(pos), slot_mapping=torch.cat(slots), query_start_loc=q,
        seq_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32), block_tables=tables,
        max_query_len=int((q[1:] - q[:-1]).max()), logits_indices=(q[1:] - 1).long(),
    )


def teacher_forced(model, seqs: list[list[int]], prompt_lens: list[int], decode: bool, kv_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Per sequence, the (L - p, vocab) logits predicting tokens p..L-1 with the sequence forced:
    one prefill of the whole sequence (decode=False), or the prompt's prefill and then one decode
    step per token with all of `seqs` in the batch (decode=True)."""
    block = 16
    per = max(-(-len(s) // block) for s in seqs)
    tables = torch.arange(len(seqs) * per, dtype=torch.int32).reshape(len(seqs), per)
    kv = allocate_kv_cache(model.cfg, len(seqs) * per, block, kv_dtype)
    if not decode:
        out = []
        for i, s in enumerate(seqs):
            b = _forward_batch([s], [0], tables[i:i + 1], block)
            b.logits_indices = torch.arange(prompt_lens[i] - 1, len(s) - 1)
            out.append(model(b, kv))
        return out
    first = model(_forward_batch([s[:p] for s, p in zip(seqs, prompt_lens)], [0] * len(seqs), tables, block), kv)
    out = [[r] for r in first]
    for t in range(max(len(s) - p for s, p in zip(seqs, prompt_lens)) - 1):
        live = [i for i, (s, p) in enumerate(zip(seqs, prompt_lens)) if p + t + 1 < len(s)]
        b = _forward_batch([seqs[i][:prompt_lens[i] + t + 1] for i in live], [prompt_lens[i] + t for i in live], tables[live], block)
        for i, r in zip(live, model(b, kv)):
            out[i].append(r)
    return [torch.stack(o) for o in out]


def one_call_equals_loop(model, monkeypatch, decode_steps: int, kv_dtype: torch.dtype = torch.float32) -> list[int]:
    """Teacher-force 1, 3 and 7 random sequences (their last `decode_steps` tokens decoded) with the
    one-call step and with the per-layer loop over a KV pool of kv_dtype (uint8: --kv-cache-dtype
    int8's rows): bit-equal logits asserted; returns the row count of each one-call step
    (fast.ops.decode_layers is watched)."""
    fast, calls = model.fast, []
    one_call = fast.ops.decode_layers
    monkeypatch.setattr(fast.ops, "decode_layers", lambda *a: calls.append(a[3].shape[0]) or one_call(*a))
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 20, 5, 33, 14, 7, 26)]
    for live in (seqs[:1], seqs[:3], seqs):
        prompts = [len(s) - 1 - decode_steps for s in live]
        fast.fused_step = True
        fused = teacher_forced(model, live, prompts, decode=True, kv_dtype=kv_dtype)
        fast.fused_step = False
        loop = teacher_forced(model, live, prompts, decode=True, kv_dtype=kv_dtype)
        assert all(torch.equal(a, b) for a, b in zip(fused, loop)), [float((a - b).abs().max()) for a, b in zip(fused, loop)]
    return calls


@pytest.mark.parametrize("arch,qtype,acts,windows,kv", [("llama", "Q4_1", "float", (), "auto"), ("qwen2", "Q8_0", "int16", (), "auto"),
                                                       ("llama", "Q4_0", "int8", (), "auto"), ("llama", "Q8_0", "float", (9, 5, 5), "auto"),
                                                       ("llama", "Q4_1", "int16", (), "int8")])
def test_one_call_decode_step_equals_the_layer_loop(tmp_path, monkeypatch, arch, qtype, acts, windows, kv, isa):  # noqa: F811
    """kv int8: the pool of --kv-cache-dtype int8 (Hadamard-rotated uint8 rows), which step_ops.c writes and reads with
    the same C kernels as the loop."""
    save_tiny_model(tmp_path / "hf", arch=arch, hidden_size=64, intermediate_size=128, num_hidden_layers=3)
    write_gguf(tmp_path / "m.gguf", tmp_path / "hf", qtype)
    _, model = load_model(tmp_path / "m.gguf", EngineConfig(num_blocks=64, block_size=16, quant_activations=acts))
    if windows:  # sliding windows of 9 keys on layer 0, 5 on layers 1-2 (a GGUF carries none): pd_layer.window against the loop's
        # (every layer slides: one block table; a full layer among them would make KV groups, which the one-call step leaves)
        model.cfg = dataclasses.replace(model.cfg, layer_windows=windows)
        model.enable_fast_path(activations=acts)
    fast = model.fast
    assert fast.step_layers is not None and fast.fused_step
    calls = one_call_equals_loop(model, monkeypatch, decode_steps=3, kv_dtype=kv_quant.storage_dtype(kv, torch.float32))  # 7 rows: the tiled path
    assert calls == [1] * 3 + [3] * 3 + [7] * 3  # each fused decode step made the one call; the loop never did


@pytest.mark.parametrize("arch,blocker", [("gemma2", "norms on the attention and MLP outputs"), ("gemma3", "per-head q/k norms"),
                                         ("qwen3", "per-head q/k norms")])
def test_models_the_one_call_step_does_not_compute_take_the_layer_loop(tmp_path, monkeypatch, arch, blocker):
    """Gemma 2 / 3 (and Qwen3) served from a Q8_0 GGUF keep their blocks on the fast path, but
    step_ops.c's one call is the Llama layer: one_call_blocker names why, the step is never built
    or called, and every decode runs the per-op loop, which matches the float twin."""
    from pdserve.runtime.cpu_forward import one_call_blocker

    extra = dict(head_dim=32, sliding_window=8, tie_word_embeddings=True, query_pre_attn_scalar=32) if arch != "qwen3" else {}
    save_tiny_model(tmp_path / "hf", arch=arch, hidden_size=64, intermediate_size=128, num_hidden_layers=3, **extra)
    write_gguf(tmp_path / "m.gguf", tmp_path / "hf", "Q8_0", arch=arch)
    quant = LLMEngine.load(tmp_path / "m.gguf", EngineConfig(num_blocks=64, block_size=8, quant_activations="float"), progress=False,
                           tokenizer=False)
    fast = quant.model.fast
    assert quant.model.quantized and fast is not None
    assert one_call_blocker(quant.model.cfg).startswith(blocker) and fast.one_call_blocker == one_call_blocker(quant.model.cfg)
    assert fast.step_layers is None and not fast.fused_step
    llama = dataclasses.replace(quant.model.cfg, architecture="LlamaForCausalLM", qk_norm=False, sandwich_norms=False, activation="silu",
                                attn_softcap=0.0, rope_local_theta=0.0, layer_windows=())  # (Gemma's windows: KV groups, which block it too)
    assert one_call_blocker(llama) is None  # the embedding scale, attention scale and final soft-cap do not block it
    monkeypatch.setattr(fast.ops, "decode_layers", lambda *a: pytest.fail("the one-call step ran"))
    twin = LLMEngine.load(tmp_path / "m.gguf", EngineConfig(num_blocks=64, block_size=8, quantization="none"), progress=False,
                          tokenizer=False)
    prompts = [[5, 9, 12, 30, 7], list(range(3, 40)), [17]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    for got, want in zip(quant.generate(prompts, params), twin.generate(prompts, params)):
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-3


def shipped_prompts() -> list[str]:
    path = Path(__file__).resolve().parents[2] / "pdserve" / "data" / "prompts.jsonl"
    return [json.loads(line)["conversations"][0]["value"] for line in path.read_text().splitlines() if line.strip()]


def greedy_scored(model, prompts: list[list[int]], max_tokens: int, eos_ids: set[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt with the model's greedy continuation (up to max_tokens, ending after an eos token),
    and per sequence the (L - p, vocab) logits that chose tokens p..L-1: teacher_forced's decode mode
    forced on the model's own choices, so the generation and its scores are one computation."""
    block = 16
    per = -(-(max(len(p) for p in prompts) + max_tokens) // block)
    tables = torch.arange(len(prompts) * per, dtype=torch.int32).reshape(len(prompts), per)
    kv = allocate_kv_cache(model.cfg, len(prompts) * per, block, torch.float32)
    seqs = [list(p) for p in prompts]
    scores = [[r] for r in model(_forward_batch(seqs, [0] * len(seqs), tables, block), kv)]
    for s, o in zip(seqs, scores):
        s.append(int(o[-1].argmax()))
    while live := [i for i, s in enumerate(seqs) if len(s) - len(prompts[i]) < max_tokens and s[-1] not in eos_ids]:
        b = _forward_batch([seqs[i] for i in live], [len(seqs[i]) - 1 for i in live], tables[live], block)
        for i, r in zip(live, model(b, kv)):
            scores[i].append(r)
            seqs[i].append(int(r.argmax()))
    return seqs, [torch.stack(o) for o in scores]


@pytest.mark.timeout(180)  # measured 20-70 s on 2 cores
@pytest.mark.slow
def test_default_model_quantized_scores_like_float_twin_teacher_forced():
    twin = LLMEngine.load(None, EngineConfig(num_blocks=512, quantization="none"), progress=False)
    _, quant = load_model(None, EngineConfig())  # default: int16 activations at every batch size
    _, quantf = load_model(None, EngineConfig(quant_activations="float"))
    _, quant8 = load_model(None, EngineConfig(quant_activations="int8"))
    assert quant.quantized and quant8.quantized and quant.weight_bytes() < 0.2 * twin.model.weight_bytes()
    texts = shipped_prompts()
    assert len(texts) == 54
    prompts = [render_chat(twin.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    seqs, ref = greedy_scored(twin.model, prompts, 16, twin.eos_ids)  # the float twin's greedy text, scored as it is chosen
    lens = [len(p) for p in prompts]
    results = {}
    for name, model, decode in (("prefill, int16 activations", quant, False), ("prefill, float activations", quantf, False),
                                ("decode 4 rows, int16 activations", quant, True),
                                ("decode 4 rows, int8 activations", quant8, True)):
        got = []
        for g in range(0, len(seqs), 4):  # decode steps of 4 rows: the int8 path's batch
            got += teacher_forced(model, seqs[g:g + 4], lens[g:g + 4], decode)
        r, q = torch.cat(ref), torch.cat(got)
        logp = torch.log_softmax(r, -1)
        kl = float(torch.sum(logp.exp() * (logp - torch.log_softmax(q, -1)), -1).mean())
        agree = float((r.argmax(-1) == q.argmax(-1)).float().mean())
        results[name] = (agree, kl, r.shape[0])
        print(f"quantized ({name}) vs float twin, teacher-forced: top-1 {agree:.2%} over {r.shape[0]} positions, mean KL {kl:.5f}")
    # The default paths (int16 activations in prefill and decode) meet the goals (top-1 >= 99%,
    # mean KL <= 0.01; measured 99.88% (one position of 852) and 100%, KL 0.00000; float activations
    # in prefill: 100%, 0.00000). The int8-activation path does
    # not (measured 95.9%, KL 0.0100 on an
    # AVX2 EPYC): rounding each 32-wide block of activations to 8 bits costs this 135M model more
    # than Q4_1 itself, which is why it is opt-in; its bounds here guard against it getting worse.
    bounds = {"prefill, int16 activations": (0.99, 0.01), "prefill, float activations": (0.99, 0.01),
              "decode 4 rows, int16 activations": (0.99, 0.01),
              "decode 4 rows, int8 activations": (0.93, 0.02)}
    for name, (agree, kl, n) in results.items():
        assert n >= 54 * 5
        assert agree >= bounds[name][0] and kl <= bounds[name][1], f"{name}: top-1 {agree:.2%}, mean KL {kl:.5f}"
