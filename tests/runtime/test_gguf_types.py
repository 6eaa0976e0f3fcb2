"""GGUF tensor types beyond the ones the gguf package can quantize: every type it can dequantize
(K-quants, I-quants, TQ, MXFP4, ...) loads, equal to the package's own dequantization with the
Q/K permutation undone; files mixed as llama.cpp's Q4_K_M / Q5_K_M / IQ4_XS presets decode
greedily like HF transformers on the same file; a type the package cannot dequantize is refused
with an error naming it.

The files are written here: for a type the package can only dequantize, each tensor is made of
raw blocks drawn from random bytes, keeping those whose values are finite and of weight-like size
(any bit pattern is a valid block; the filter only keeps the scales sane)."""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from pdserve.common.errors import UnsupportedModelError
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve.runtime.weights import gguf_dequantizable, load_checkpoint, supported_gguf_types, unpermute_qk
from pdserve_client.params import SamplingParams
from tests.helpers import assert_greedy_equal, hf_greedy

# hidden and intermediate sizes are multiples of 256: every row is whole K-quant blocks
CFG = dict(vocab=512, hidden=256, ffn=512, layers=2, heads=4, kv_heads=2, context=256)
QUANTIZABLE_ALREADY_TESTED = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"}
ONLY_DEQUANTIZED = [t for t in supported_gguf_types() if t not in QUANTIZABLE_ALREADY_TESTED]


def random_blocks(qtype: GGMLQuantizationType, n: int, rng: np.random.Generator, peak: float, pool: int = 256) -> np.ndarray:
    """n raw blocks of qtype, (n, type_size) uint8, drawn from a pool of random valid blocks whose
    values are finite with a largest magnitude in [0.005, peak]."""
    block, size = GGML_QUANT_SIZES[qtype]
    kept, total = [], 0
    for _ in range(200):
        cand = rng.integers(0, 256, (8192, size), dtype=np.uint8)
        with np.errstate(all="ignore"):
            vals = quants.dequantize(cand, qtype).reshape(len(cand), block).astype(np.float64)
            top = np.abs(vals).max(axis=1)
        ok = np.isfinite(vals).all(axis=1) & (top >= 0.005) & (top <= peak)
        kept.append(cand[ok])
        total += int(ok.sum())
        if total >= pool:
            break
    chosen = np.concatenate(kept)
    assert len(chosen) >= pool, f"{qtype.name}: only {len(chosen)} usable random blocks"
    return chosen[rng.integers(0, len(chosen), n)]


def layer_tensors() -> dict[str, tuple[int, int]]:
    """GGUF tensor name -> (rows, row length) of a tiny Llama (2-D tensors only)."""
    c = CFG
    head_dim = c["hidden"] // c["heads"]
    shapes = {"token_embd.weight": (c["vocab"], c["hidden"]), "output.weight": (c["vocab"], c["hidden"])}
    for i in range(c["layers"]):
        shapes.update({
            f"blk.{i}.attn_q.weight": (c["hidden"], c["hidden"]), f"blk.{i}.attn_k.weight": (c["kv_heads"] * head_dim, c["hidden"]),
            f"blk.{i}.attn_v.weight": (c["kv_heads"] * head_dim, c["hidden"]), f"blk.{i}.attn_output.weight": (c["hidden"], c["hidden"]),
            f"blk.{i}.ffn_gate.weight": (c["ffn"], c["hidden"]), f"blk.{i}.ffn_up.weight": (c["ffn"], c["hidden"]),
            f"blk.{i}.ffn_down.weight": (c["hidden"], c["ffn"]),
        })
    return shapes


def write_raw_gguf(path, pick_type, seed: int = 0, peak: float = 0.3) -> dict[str, np.ndarray]:
    """A tiny Llama GGUF whose 2-D tensors are random raw blocks of pick_type(name) (a type name),
    weights at most `peak` in magnitude; returns {gguf name: the float32 matrix the package
    dequantizes it to}."""
    rng = np.random.default_rng(seed)
    c = CFG
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_block_count(c["layers"])
    wr.add_context_length(c["context"])
    wr.add_embedding_length(c["hidden"])
    wr.add_feed_forward_length(c["ffn"])
    wr.add_head_count(c["heads"])
    wr.add_head_count_kv(c["kv_heads"])
    wr.add_rope_dimension_count(c["hidden"] // c["heads"])
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_rope_freq_base(10000.0)
    wr.add_vocab_size(c["vocab"])
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    want = {}
    for name, (rows, cols) in layer_tensors().items():
        qt = GGMLQuantizationType[pick_type(name)]
        block, size = GGML_QUANT_SIZES[qt]
        if gguf_dequantizable(qt):
            raw = random_blocks(qt, rows * cols // block, rng, peak).reshape(rows, cols // block * size)
            want[name] = quants.dequantize(raw, qt).reshape(rows, cols).astype(np.float32)
        else:  # a type the package cannot dequantize: its bytes are never read
            raw = np.zeros((rows, cols // block * size), np.uint8)
        wr.add_tensor(name, raw, raw_dtype=qt)
    for i in range(c["layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            wr.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(c["hidden"])).astype(np.float32))
    wr.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(c["hidden"])).astype(np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return want


HF_NAMES = {"token_embd": "model.embed_tokens", "output": "lm_head", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}.weight"
    return f"{HF_NAMES[parts[0]]}.weight"


def test_k_and_i_quants_are_supported():
    assert {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL", "IQ2_XXS", "IQ3_S", "IQ1_M"} <= set(supported_gguf_types())


@pytest.mark.parametrize("qtype", ONLY_DEQUANTIZED)
def test_every_dequantizable_type_loads(tmp_path, qtype):
    want = write_raw_gguf(tmp_path / f"m-{qtype}.gguf", lambda name: qtype, peak=np.inf)  # loading only: any finite block
    cfg, tensors = load_checkpoint(tmp_path / f"m-{qtype}.gguf", progress=False)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers) == (256, 4, 2, 2)
    for name, w in want.items():
        if ".attn_q." in name or ".attn_k." in name:
            w = unpermute_qk(torch.from_numpy(w), cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads).numpy()
        np.testing.assert_array_equal(tensors[hf_name(name)].numpy(), w, err_msg=f"{qtype} {name}")


def q4_k_m(name):  # llama.cpp's Q4_K_M keeps attn_v, ffn_down and the output layer in Q6_K
    return "Q6_K" if any(k in name for k in ("attn_v", "ffn_down", "output.")) else "Q4_K"


def q5_k_m(name):
    return "Q6_K" if any(k in name for k in ("attn_v", "ffn_down", "output.")) else "Q5_K"


def iq4_xs(name):
    return "Q6_K" if "output." in name else "IQ4_XS"


def q3_k_s(name):
    return "Q3_K" if "ffn" in name else "Q2_K"


@pytest.mark.slow
@pytest.mark.parametrize("mix", [q4_k_m, q5_k_m, iq4_xs, q3_k_s], ids=lambda f: f.__name__)
def test_k_quant_file_greedy_matches_hf_transformers_on_the_same_file(tmp_path, mix):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{mix.__name__}.gguf"
    write_raw_gguf(path, mix, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    eng = LLMEngine.load(path, EngineConfig(num_blocks=32, block_size=8), progress=False, tokenizer=False)
    prompts = [[5, 9, 33, 100, 7, 250, 3], [400, 12, 77]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = eng.generate(prompts, params)
    compared = 0
    for p, out in zip(prompts, got):
        ref, logits = hf_greedy(hf, p, 24, eos=False)
        compared += assert_greedy_equal(out.token_ids, ref, logits, mix.__name__)
    assert compared >= 24  # near-ties are rare, not the rule


@pytest.mark.parametrize("qtype", ["Q8_1", "Q8_K"])
def test_a_type_the_package_cannot_dequantize_is_named(tmp_path, qtype):
    def one_bad(name):
        return qtype if name == "blk.0.ffn_up.weight" else "Q4_K"

    path = tmp_path / "bad.gguf"
    write_raw_gguf(path, one_bad)
    with pytest.raises(UnsupportedModelError, match=f"unsupported GGUF tensor type\\(s\\) {qtype}: the installed gguf package .* "
                                                    f"cannot dequantize them \\(supported: .*Q4_K.*IQ4_XS"):
        load_checkpoint(path, progress=False)
