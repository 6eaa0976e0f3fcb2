"""A tiny Llama (written by HF transformers) converted to GGUF K-quants and served from its blocks.

- "Q4_K_M" as llama-quantize mixes it (tests.helpers.tensor_qtype): Q4_K matrices, attn_v and
  ffn_down in Q6_K on the layers use_more_bits picks, output in Q6_K, and Q5_0 / Q8_0 where a
  row (ffn_down's, 640 wide) is not a multiple of 256. Loaded packed (`--quantization auto`, int16
  activations) and dequantized (`none`): every matrix stays in its type, the weights take about
  the blocks' bytes, and greedy decoding agrees with the float twin token for token, allowing a
  divergence only where the twin's own top-two logits are within LOGIT_GAP. The int16 activation
  rounding (1/32767 of each 32-wide block's largest value; the K-quants' decode steps of <= 4 rows:
  of each 256-wide super-block's, kernels.quant.K256_ROWS) moves this random model's logits (largest
  ~16) by up to 8.1e-2, measured (1.8e-2 when every K-quant row was rounded per 32; no greedy
  token changed either way; int8 activations, per 32 or per 256, change tokens here at gaps of
  ~6, which is why this test runs int16); the unchanged Q8_0 path on the same model by 0.9e-2,
  and float activations (summation order only) by 5e-5; the figure is printed. A layer whose q/k/v mix Q4_K and Q6_K keeps each
  in its blocks (QuantTensor.cat declines; model.QuantRows, the fast path's SplitLinear: one
  quantized linear per part, no float32 copy); the one-call decode step takes its parts (step_ops.c
  pd_layer.qkv[]: each part's columns of the fused output); with float activations such a model's
  logits equal its dequantized twin's to summation order.
- Files of one K-quant each (Q4_K, Q6_K: every projection packed) and Q4_K_M's mix run the
  one-call decode step (kernels/csrc/step_ops.c), which equals the per-op loop bit for bit
  (logits), at the direct (1, 3 rows) and the integer-GEMM (7+ rows) row counts, int16 and float activations.
"""
import pytest

from pdserve.kernels import cpu_native
from pdserve.kernels.quant import QTYPES, block_weights
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine, load_model
from pdserve_client.params import SamplingParams
from tests.helpers import save_tiny_model, write_gguf
from tests.runtime.test_quantized import greedy_scored, one_call_equals_loop

pytestmark = pytest.mark.skipif(cpu_native.native() is None, reason="needs a C compiler for the quantized kernels")

LOGIT_GAP = 5e-2  # absolute: the int16 activations' rounding (logits moved <= ~8e-2) may flip only a near-tie of the float twin
SHAPE = dict(arch="llama", hidden_size=256, intermediate_size=640, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_q4_k_m_file_decodes_like_its_float_twin(tmp_path):
    save_tiny_model(tmp_path / "hf", **SHAPE)
    write_gguf(tmp_path / "m.gguf", tmp_path / "hf", "Q4_K_M")
    cfg = EngineConfig(num_blocks=64, block_size=8)
    quant = LLMEngine.load(tmp_path / "m.gguf", cfg, progress=False, tokenizer=False)
    twin = LLMEngine.load(tmp_path / "m.gguf", EngineConfig(num_blocks=64, block_size=8, quantization="none"), progress=False, tokenizer=False)
    kept = {n: q.qtype for n, q in quant.model.quantized.items()}
    assert set(kept.values()) == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}, kept
    assert kept["layers.0.self_attn.qkv_proj.weight"] == "Q4_K"  # layer 0: q, k, v all Q4_K, fused as blocks
    assert [kept[f"layers.1.self_attn.qkv_proj.parts.{i}.weight"] for i in range(3)] == ["Q4_K", "Q4_K", "Q6_K"]  # layer 1: v in Q6_K
    assert kept["layers.0.mlp.down_proj.weight"] == "Q5_0" and kept["layers.1.mlp.down_proj.weight"] == "Q8_0"  # 640 wide
    assert kept["lm_head.weight"] == "Q6_K" and kept["layers.1.mlp.gate_up_proj.weight"] == "Q4_K"
    packed = sum(q.nbytes for q in quant.model.quantized.values())
    as_float = sum(q.shape[0] * q.shape[1] * 4 for q in quant.model.quantized.values())
    ratio = max(QTYPES[t][1] / (block_weights(t) * 4) for t in kept.values())
    assert packed <= as_float * ratio and quant.model.weight_bytes() < twin.model.weight_bytes() - as_float + packed + 1024
    assert quant.model.fast is not None and quant.model.fast.step_layers is not None  # a split qkv: its parts in the one call

    prompts = [[5, 9, 12, 30, 7], list(range(3, 40)), [17]]
    seqs_t, scores_t = greedy_scored(twin.model, prompts, 16, set())
    seqs_q, scores_q = greedy_scored(quant.model, prompts, 16, set())
    worst = 0.0
    for p, st, sq, lt, lq in zip(prompts, seqs_t, seqs_q, scores_t, scores_q):
        for i, (a, b) in enumerate(zip(sq[len(p):], st[len(p):])):
            worst = max(worst, float((lq[i] - lt[i]).abs().max()))
            if a != b:  # allowed only at the twin's near-tie; past it the sequences are not comparable
                gap = float(lt[i][b] - lt[i][a])
                assert gap <= LOGIT_GAP, f"token {i} differs ({a} vs twin {b}) with twin logit gap {gap:.2e}"
                break
    print(f"Q4_K_M packed vs dequantized: largest logit difference before any divergence {worst:.2e}")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)  # the engine's generate takes the same path
    assert [c.token_ids for c in quant.generate(prompts, params)] == [s[len(p):] for p, s in zip(prompts, seqs_q)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_type_qkv_stays_in_its_blocks_and_equals_the_dequantized_twin(tmp_path, arch):
    """Q4_K_M's layer 1 here has q / k in Q4_K and v in Q6_K: the three stay in their blocks
    (model.QuantRows; the fast path's SplitLinear, one PackedLinear each), taking their blocks'
    bytes instead of a float32 fused qkv's 4 a weight, and with float activations the logits of
    a prompt (fast path and module forward) and of 8 greedy decode steps equal the dequantized
    twin's to float32 summation order (Qwen2: its q/k/v biases split among the parts)."""
    import torch

    from pdserve.runtime.cpu_forward import SplitLinear
    from tests.helpers import all_position_logits

    save_tiny_model(tmp_path / "hf", **{**SHAPE, "arch": arch})
    write_gguf(tmp_path / "m.gguf", tmp_path / "hf", "Q4_K_M", arch=arch)
    _, quant = load_model(tmp_path / "m.gguf", EngineConfig(num_blocks=64, block_size=8, quant_activations="float"))
    _, twin = load_model(tmp_path / "m.gguf", EngineConfig(num_blocks=64, block_size=8, quantization="none"))
    parts = [quant.quantized[f"layers.1.self_attn.qkv_proj.parts.{i}.weight"] for i in range(3)]
    assert [p.qtype for p in parts] == ["Q4_K", "Q4_K", "Q6_K"] and "layers.1.self_attn.qkv_proj.weight" not in quant.quantized
    qkv = quant.fast.layers[1].qkv
    assert isinstance(qkv, SplitLinear) and [lin.weight for lin in qkv.parts] == parts and quant.fast.step_layers is not None
    assert (qkv.parts[0].bias is not None) == (arch == "qwen2")
    fused_float = sum(p.shape[0] for p in parts) * parts[0].shape[1] * 4
    assert sum(p.nbytes for p in parts) < fused_float / 5

    ids = list(range(3, 40))
    ref = all_position_logits(twin, ids, torch.float32)
    assert (all_position_logits(quant, ids, torch.float32) - ref).abs().max() <= 1e-4 * ref.abs().max()
    fast, quant.fast = quant.fast, None  # the module forward: QuantRows (dequantize + F.linear per part), the twin on the CPU
    assert (all_position_logits(quant, ids, torch.float32) - ref).abs().max() <= 1e-4 * ref.abs().max()
    quant.fast = fast
    prompts = [[5, 9, 12, 30, 7], [17]]
    seqs_t, scores_t = greedy_scored(twin, prompts, 8, set())
    seqs_q, scores_q = greedy_scored(quant, prompts, 8, set())
    for st, sq, lt, lq in zip(seqs_t, seqs_q, scores_t, scores_q):
        same = next((i for i, (a, b) in enumerate(zip(sq, st)) if a != b), len(st)) - (len(st) - len(lt))  # steps before any divergence
        assert same >= 4 and (lq[:same] - lt[:same]).abs().max() <= 1e-4 * lt.abs().max()


@pytest.mark.parametrize("qtype,acts,arch", [("Q4_K", "int16", "llama"), ("Q6_K", "int16", "llama"), ("Q4_K", "float", "llama"),
                                             ("Q5_K", "int8", "llama"), ("Q4_K_M", "int16", "llama"), ("Q4_K_M", "float", "qwen2")])
def test_one_call_decode_step_takes_k_quants_and_equals_the_layer_loop(tmp_path, monkeypatch, qtype, acts, arch):
    """Q4_K_M: layer 1's qkv is Q4_K q / k and Q6_K v (three parts; Qwen2: with their biases)."""
    save_tiny_model(tmp_path / "hf", **{**SHAPE, "intermediate_size": 512, "arch": arch})
    write_gguf(tmp_path / "m.gguf", tmp_path / "hf", qtype, arch=arch)
    _, model = load_model(tmp_path / "m.gguf", EngineConfig(num_blocks=64, block_size=16, quant_activations=acts))
    if qtype == "Q4_K_M":
        assert len(model.fast.layers[1].qkv.parts) == 3
    else:
        assert {q.qtype for q in model.quantized.values()} == {qtype}
    fast = model.fast
    assert fast.step_layers is not None and fast.fused_step
    calls = one_call_equals_loop(model, monkeypatch, decode_steps=2)  # 7 rows: int16's GEMM
    assert calls == [1] * 2 + [3] * 2 + [7] * 2  # each fused decode step made the one call; the loop never did


def test_a_measured_back_end_table_covers_each_part_of_a_mixed_type_qkv(tmp_path):
    """`--linear-backend auto` (the workers' default) measures every PackedLinear's shape, a
    SplitLinear's parts each on its own (Q4_K q / k, Q6_K v): a model whose fused qkv mixes types
    loads with a table and every part runs a back-end from it."""
    from pdserve.runtime import linear_plan
    from pdserve.runtime.cpu_forward import SplitLinear

    save_tiny_model(tmp_path / "hf", **SHAPE)
    write_gguf(tmp_path / "m.gguf", tmp_path / "hf", "Q4_K_M")
    _, quant = load_model(tmp_path / "m.gguf", EngineConfig(num_blocks=64, block_size=8, linear_backend="auto"))
    assert quant.fast.fused_step  # the one-call step's rows pinned over every layer's parts (layer 1's split qkv too)
    quant.fast.layers.reverse()  # and so with the split layer first, as a 1B Q4_K_M file's layer 0 is
    linear_plan.apply(quant, EngineConfig(num_blocks=64, block_size=8, linear_backend="auto"), tmp_path / "m.gguf")
    quant.fast.layers.reverse()
    qkv = quant.fast.layers[1].qkv
    assert isinstance(qkv, SplitLinear)
    lins = linear_plan.linears(quant.fast)
    assert all(part in lins for part in qkv.parts) and not any(isinstance(x, SplitLinear) for x in lins)
    assert quant.fast.linear_table is not None and all(part.backend_at(1) for part in qkv.parts)
