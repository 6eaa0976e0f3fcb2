"""Test helpers: tiny random HF checkpoints written to disk, and the greedy-equality check.

Greedy equality with transformers allows exactly one kind of divergence: at a step where HF's
own top-two logits are within LOGIT_GAP_TOL of each other (a near-tie that float rounding of a
different but valid summation order can flip). After such a step the sequences are no longer
comparable, so the check stops there. Anything else is a failure.
"""
from __future__ import annotations

import os

import torch

from pdserve.ports import free_port  # noqa: F401  (the one free_port; tests import it from here)

LOGIT_GAP_TOL = 1e-3  # absolute logit gap, float32


MOE_ARCHES = ("mixtral", "qwen3_moe", "qwen2_moe")
ROUTER_SCALE = 1.5  # MoE routers' random weights times this (router logits of std ~3: far from ties, yet no expert dominates)


def save_tiny_model(path, arch: str = "llama", seed: int = 0, **overrides) -> dict:
    """Write a randomly initialised small Llama, Qwen2, Mistral, Qwen3, Phi-3, Gemma 2 or Gemma 3 (text)
    checkpoint (safetensors) to `path`; or a Mixtral, Qwen3-MoE or Qwen2-MoE (MOE_ARCHES; 8 experts,
    top 2 unless overridden; routers scaled by ROUTER_SCALE). Norm weights that transformers starts
    at ones (Qwen3's q/k norms) or zeros (Gemma's, which scale by 1 + w) are drawn at random, so that they act."""
    import transformers

    base = dict(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.25,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch == "mixtral":
        base.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48)
    elif arch in MOE_ARCHES:
        base.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
        if arch == "qwen2_moe":
            base.update(shared_expert_intermediate_size=96)
    base.update(overrides)
    torch.manual_seed(seed)
    family = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "qwen3": "Qwen3", "phi3": "Phi3", "gemma2": "Gemma2",
              "gemma3": "Gemma3", "mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe"}[arch]
    config = getattr(transformers, f"{family}TextConfig" if arch == "gemma3" else f"{family}Config")(**base)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    if arch in MOE_ARCHES:  # routers far from ties
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.mul_(ROUTER_SCALE)
    if arch in ("qwen3", "qwen3_moe"):  # q_norm / k_norm start at ones: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    if arch.startswith("gemma"):  # every RMSNorm starts at zeros (a scale of 1 + 0): draw them, so 1 + w differs from w
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(-0.5, 0.5)
    model.save_pretrained(str(path), safe_serialization=True)
    return base


def all_position_logits(model, ids: list[int], dtype) -> torch.Tensor:
    """(L, vocab) float32 logits of every position of one sequence, in one prefill of a model
    (runtime.model.LlamaModel) on a fresh KV cache."""
    from pdserve.runtime.kv_cache import allocate_kv_cache
    from pdserve.runtime.model import ForwardBatch

    n, block = len(ids), 16
    blocks = -(-n // block)
    kv = allocate_kv_cache(model.cfg, blocks, block, dtype)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None], max_query_len=n, logits_indices=torch.arange(n),
    )
    return model(batch, kv).float()


class TPRank:
    """A runtime.tp_model.TPModel's own step (`run`: no plan sent), called as all_position_logits calls a model."""

    def __init__(self, model):
        self.model, self.cfg = model, model.cfg

    def __call__(self, batch, kv):
        return self.model.run(batch, kv)


def in_tp_threads(cfg, tensors: dict, econf, n: int, fn, timeout_s: float = 120) -> dict:
    """{rank: fn(its TPModel)} from n ranks of one TP group, each a thread of this process (a
    real gloo group on loopback; runtime.build.build_model builds each rank's model from the
    whole checkpoint's tensors). fn runs on every rank at once (its collectives need them all)."""
    import shutil
    import threading

    from pdserve.runtime.build import build_model
    from pdserve.runtime.tp import RankGroup, make_rendezvous

    rendezvous, got = make_rendezvous(), {}

    def rank(r: int):
        try:
            group = RankGroup(r, n, rendezvous).connect()
            got[r] = fn(build_model(cfg, tensors, econf, group=group))
        except Exception as e:  # noqa: BLE001 (the caller's assert reports it)
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)
    assert all(r in got and not isinstance(got[r], Exception) for r in range(n)), got
    return got


def hf_from_gguf(path):
    """HF transformers' model of a GGUF file, dequantized to float32. Its GGUF loader parses the
    file twice (config, then weights) and rebuilds gguf's tensor-name map once per module (~400
    times): ~60% of its load time. Both are pure functions of their arguments, so they are
    memoized for this load; what HF computes is unchanged."""
    import functools

    import gguf
    import pytest
    from transformers import AutoModelForCausalLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: bool = True):
    """HF transformers greedy generate: (new token ids, per-step logits)."""
    out = model.generate(
        torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
        eos_token_id=model.generation_config.eos_token_id if eos else None, pad_token_id=0,
    )
    return out.sequences[0, len(prompt_ids):].tolist(), [l[0].float() for l in out.logits]


def assert_greedy_equal(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor], what: str = "") -> int:
    """Token-for-token equality, allowing divergence only at a near-tie; returns tokens compared."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = float(ref_logits[i][b] - ref_logits[i][a])
            assert gap <= LOGIT_GAP_TOL, f"{what}: token {i} differs ({a} vs HF {b}) with HF logit gap {gap:.2e} > {LOGIT_GAP_TOL}"
            return i
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens vs HF {len(ref)}: {ours} vs {ref}"
    return len(ours)


def permute_qk(w, n_heads):
    """llama.cpp's convert-time Q/K permutation (what runtime.weights.unpermute_qk undoes)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",  # Qwen3
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3 (fused; llama.cpp's phi3 names)
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",  # MoE
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Gemma 2 / 3's norms (llama.cpp's gemma2 / gemma3 names): its ffn_norm is the MLP's input norm
GGUF_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                    "post_feedforward_layernorm": "post_ffw_norm"}


GGUF_EXPERT_STACKS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _moe_for_gguf(w: dict) -> tuple[dict, dict]:
    """(the other tensors, with Mixtral's block_sparse_moe renamed mlp; the experts' stacks
    (E, rows, columns) by our loader's name, as llama.cpp's converter merges them)."""
    import re

    import numpy as np

    rest, per = {}, {}
    for name, t in w.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight", name)
        if not m:
            rest[name] = t
            continue
        kind = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m.group(3), m.group(3))
        per.setdefault(f"{m.group(1)}.{kind}", {})[int(m.group(2))] = t
    return rest, {k: np.stack([v[e] for e in sorted(v)]) for k, v in per.items()}


def write_gguf(path, hf_dir, qtype: str = "F32", arch: str = "llama", tie: bool | None = None, extra: dict | None = None,
               vocab_key: bool = True, tokenizer_from=None, experts_qtype: str | None = None) -> dict:
    """Convert a tiny HF llama (qwen2, qwen3, phi3, gemma2, gemma3) checkpoint to GGUF the way llama.cpp does (llama: Q/K
    permuted; phi3: fused attn_qkv and ffn_up as they are, rope.dimension_count written; gemma: every
    norm weight stored as 1 + w, the soft-caps, sliding window, the sliding layers' rope base
    (gemma3: rope.freq_base_swa) and rope scaling (linear, yarn) written as convert_hf_to_gguf.py writes them;
    {arch}.vocab_size only for the llama arch, as the converter writes it, and vocab_key True).
    A mixture of experts (arch llama for Mixtral, qwen2moe, qwen3moe): expert_count / expert_used_count
    (and the experts' and shared expert's widths), the router as ffn_gate_inp, each matrix of every
    expert merged into one 3-D ffn_{gate,up,down}_exps (quantized too, K-quants included: rows of
    256 multiples), Qwen2-MoE's shared expert
    as ffn_*_shexp and its gate as the F32 vector ffn_gate_inp_shexp. experts_qtype: the expert
    stacks' type where it is not `qtype` (K-quant experts beside Q8_0 matrices narrower than 256 a rank).

    extra: further GGUF tensors (name -> float32 array) written as they are, e.g. ones a loader must refuse.
    tokenizer_from: a GGUF whose tokenizer (tokenizer.ggml.*, the chat template) is copied in, so that
    a service can tokenize for this one (the checkpoint's vocabulary must be that tokenizer's).
    Returns the dequantized, un-permuted tensors a correct loader must produce (phi3: still fused).
    """
    import json
    import re

    import gguf
    import numpy as np
    from gguf import quants
    from safetensors.numpy import load_file

    cfg = json.load(open(f"{hf_dir}/config.json"))
    w = load_file(f"{hf_dir}/model.safetensors")
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv)
    if cfg.get("head_dim"):  # as convert_hf_to_gguf.py writes it (Qwen3: head_dim need not be hidden / heads)
        wr.add_key_length(cfg["head_dim"])
        wr.add_value_length(cfg["head_dim"])
    if arch == "phi3":
        wr.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    gemma = arch in ("gemma2", "gemma3")
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":
        full, local = rope["full_attention"], rope["sliding_attention"]
        wr.add_rope_freq_base(full["rope_theta"])
        wr.add_float32(f"{arch}.rope.freq_base_swa", local["rope_theta"])
        if full.get("rope_type") == "linear":
            wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            wr.add_rope_scaling_factor(full["factor"])
    else:
        wr.add_rope_freq_base(rope.get("rope_theta", 10000.0))
        if rope.get("rope_type") == "linear":
            wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            wr.add_rope_scaling_factor(rope["factor"])
        elif rope.get("rope_type") == "yarn":  # convert_hf_to_gguf.py's keys (it skips mscale / mscale_all_dim / truncate)
            wr.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            wr.add_rope_scaling_factor(rope["factor"])
            wr.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            for key, add in (("attention_factor", wr.add_rope_scaling_yarn_attn_factor), ("beta_fast", wr.add_rope_scaling_yarn_beta_fast),
                             ("beta_slow", wr.add_rope_scaling_yarn_beta_slow)):
                if rope.get(key) is not None:
                    add(rope[key])
    if gemma:
        wr.add_sliding_window(cfg["sliding_window"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key):
                wr.add_float32(f"{arch}.{key}", cfg[key])
    if vocab_key and arch == "llama":  # convert_hf_to_gguf.py writes {arch}.vocab_size for the llama arch only (the others: token_embd's rows)
        wr.add_vocab_size(cfg["vocab_size"])
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    if tokenizer_from is not None:
        copy_gguf_tokenizer(wr, tokenizer_from)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:  # llama.cpp's MoE metadata (llama: Mixtral, whose feed_forward_length is the experts' width)
        wr.add_expert_count(experts)
        wr.add_expert_used_count(cfg["num_experts_per_tok"])
        if arch != "llama":
            wr.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            wr.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    expected = {}
    w, stacks = _moe_for_gguf(w)
    for name, t in [*w.items(), *stacks.items()]:
        if name == "lm_head.weight" and (tie or cfg.get("tie_word_embeddings")):
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        if name in stacks:  # a 3-D stack of every expert's matrix (our loader's name has no .weight)
            m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\w+)", name)
            gname = f"blk.{m.group(1)}.{GGUF_EXPERT_STACKS[m.group(2)]}.weight"
        elif m:
            gname = f"blk.{m.group(1)}.{(GGUF_GEMMA_NAMES.get(m.group(2)) if gemma else None) or GGUF_NAMES[m.group(2)]}.{m.group(3)}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[name]
        arr = t.astype(np.float32)
        if gemma and name.endswith("norm.weight"):
            arr = arr + 1  # llama.cpp's converter stores Gemma's (1 + w)
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            arr = permute_qk(arr, heads if "q_proj" in name else kv)
        if name.endswith("shared_expert_gate.weight"):
            arr = arr.reshape(-1)  # llama.cpp's ffn_gate_inp_shexp is a vector (hidden,), kept in F32
        stack = arr.ndim == 3 and qtype not in ("Q4_K_M", "Q5_K_M")  # an expert stack: the plain type asked (gguf's quantizer)
        qt = gguf.GGMLQuantizationType[(experts_qtype or qtype) if stack else tensor_qtype(qtype, gname, arr.shape, cfg["num_hidden_layers"])]
        if arr.ndim >= 2 and qt != gguf.GGMLQuantizationType.F32:
            data = quantize_blocks(arr.reshape(-1, arr.shape[-1]), qt.name).reshape(*arr.shape[:-1], -1)  # a stack: its experts' rows
            back = quants.dequantize(data, qt)
            wr.add_tensor(gname, data, raw_dtype=qt)
        else:
            back = arr
            wr.add_tensor(gname, arr)
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            import torch

            from pdserve.runtime.weights import unpermute_qk

            back = unpermute_qk(torch.from_numpy(np.ascontiguousarray(back)), heads if "q_proj" in name else kv).numpy()
        expected[name] = back.reshape(1, -1) if name.endswith("shared_expert_gate.weight") else back
    for gname, arr in (extra or {}).items():
        wr.add_tensor(gname, arr)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return expected


def copy_gguf_tokenizer(wr, source) -> None:
    """Write the tokenizer of the GGUF `source` (a BPE one: the default model's) into GGUFWriter
    `wr`, as llama.cpp's converter writes it (bos / eos ids: write_gguf's 1 and 2, the default model's)."""
    from pdserve.common.gguf_file import read_gguf

    meta, _ = read_gguf(str(source), keep=lambda key: key.startswith("tokenizer."))
    wr.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        wr.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    wr.add_token_list(meta["tokenizer.ggml.tokens"])
    wr.add_token_types(meta["tokenizer.ggml.token_type"])
    wr.add_token_merges(meta.get("tokenizer.ggml.merges", []))
    for key, add in (("tokenizer.ggml.unknown_token_id", wr.add_unk_token_id), ("tokenizer.ggml.padding_token_id", wr.add_pad_token_id),
                     ("tokenizer.ggml.add_bos_token", wr.add_add_bos_token), ("tokenizer.ggml.add_space_prefix", wr.add_add_space_prefix),
                     ("tokenizer.chat_template", wr.add_chat_template)):
        if key in meta:
            add(meta[key])


K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama-quantize's type where rows are not a multiple of 256


def tensor_qtype(qtype: str, gname: str, shape: tuple, layers: int) -> str:
    """The type write_gguf gives one tensor: `qtype` itself, or for the mixes "Q4_K_M" / "Q5_K_M"
    llama-quantize's choice (attn_v and ffn_down in Q6_K on the layers use_more_bits picks: the
    first and last eighth and every third between; output in Q6_K; the rest Q4_K / Q5_K); a
    K-quant's rows not a multiple of 256 fall back as llama-quantize does (K_FALLBACK)."""
    if len(shape) != 2:
        return "F32"
    if qtype in ("Q4_K_M", "Q5_K_M"):
        layer = int(gname.split(".")[1]) if gname.startswith("blk.") else -1
        more_bits = layer >= 0 and (layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2)
        big = gname == "output.weight" or (more_bits and (".attn_v." in gname or ".ffn_down." in gname))
        qtype = "Q6_K" if big else qtype[:4]
    return K_FALLBACK[qtype] if qtype in K_FALLBACK and shape[-1] % 256 else qtype


def quantize_blocks(arr, qtype: str):
    """(rows, cols) float32 -> (rows, bytes) uint8 GGUF blocks: gguf's numpy quantizer where it
    has one; for Q4_K / Q5_K / Q6_K (which it lacks) a plain round-to-nearest one here, laid out as
    llama.cpp's ggml-common.h says (tests/kernels/test_kquant.py checks it against gguf's
    dequantizer)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    if qtype not in ("Q4_K", "Q5_K", "Q6_K"):
        return quants.quantize(arr, GGMLQuantizationType[qtype])
    rows, cols = arr.shape
    x = arr.reshape(-1, 256).astype(np.float32)
    n = x.shape[0]

    def half(v):
        return v.astype(np.float16).view(np.uint8).reshape(n, 2)

    def safe(v):
        return np.where(v > 0, v, 1.0)

    if qtype == "Q6_K":
        group = np.abs(x.reshape(n, 16, 16)).max(-1) / 31  # each 16 weights' scale, codes q - 32 in -31..31
        d = half(group.max(-1) / 127)
        df = d.view(np.float16).astype(np.float32)
        sc = np.clip(np.round(group / safe(df)), 0, 127)
        q = np.clip(np.round(x.reshape(n, 16, 16) / safe(df * sc)[..., None]) + 32, 0, 63).astype(np.uint8).reshape(n, 2, 4, 32)
        ql = np.concatenate([(q[:, :, 0] & 15) | (q[:, :, 2] & 15) << 4, (q[:, :, 1] & 15) | (q[:, :, 3] & 15) << 4], -1)
        qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
        out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), d], -1)
        return out.reshape(rows, -1)
    top = 15 if qtype == "Q4_K" else 31
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - low) / top, -low
    d, dmin = half(scale.max(-1) / 63), half(mins.max(-1) / 63)
    df, dmf = d.view(np.float16).astype(np.float32), dmin.view(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / safe(df)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(mins / safe(dmf)), 0, 63).astype(np.uint8)
    q = np.clip(np.round((sub + (dmf * mn)[..., None]) / safe(df * sc)[..., None]), 0, top).astype(np.uint8)  # (n, 8, 32)
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, mn[:, :4] | (mn[:, 4:] >> 4) << 6, (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4], -1)
    qs = ((q[:, 0::2] & 15) | (q[:, 1::2] & 15) << 4).reshape(n, 128)  # byte 32c + l: sub-blocks 2c (low) and 2c + 1 (high)
    parts = [d, dmin, packed]
    if qtype == "Q5_K":
        parts.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[:, None], axis=1))  # bit i of qh[l]: sub-block i
    return np.concatenate(parts + [qs], -1).reshape(rows, -1)


def quant_blocks(qtype: str, rows: int, cols: int, seed: int = 0):
    """A random (rows, cols) kernels.quant.QuantTensor of `qtype`: gguf-quantized Gaussian weights
    for the 32-weight types; for the K-quants random bytes (every code, scale, min and high bit
    pattern, both halves of the packed scales) under fp16 scales d / dmin of sane size."""
    import numpy as np

    from pdserve.kernels.quant import K_QTYPES, QTYPES, QuantTensor

    rng = np.random.default_rng(seed)
    if qtype not in K_QTYPES:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return QuantTensor(torch.from_numpy(quantize_blocks(w, qtype)), qtype, (rows, cols))
    nsb = cols // 256
    raw = rng.integers(0, 256, (rows, nsb, QTYPES[qtype][1]), dtype=np.uint8)

    def half(lo, hi):
        return rng.uniform(lo, hi, (rows, nsb)).astype(np.float16).view(np.uint8).reshape(rows, nsb, 2)

    if qtype == "Q6_K":
        raw[..., 208:210] = half(1e-4, 1e-3)
    else:
        raw[..., 0:2], raw[..., 2:4] = half(1e-3, 3e-3), half(1e-3, 3e-3)
    return QuantTensor(torch.from_numpy(raw.reshape(rows, -1)), qtype, (rows, cols))


def family_tokenizer(family: str):
    """The default model's tokenizer as a `family` (tests/family_templates.py) checkpoint carries
    it: its bos/eos and control tokens added, and its published chat template."""
    from tokenizers import AddedToken

    from pdserve.common.tokenizer import load_tokenizer
    from tests.family_templates import FAMILY_TOKENS, TEMPLATES

    tok = load_tokenizer(None)
    spec = FAMILY_TOKENS[family]
    tok.add_special_tokens({k: v for k, v in (("bos_token", spec["bos"]), ("eos_token", spec["eos"])) if v is not None})
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]]
                   + [AddedToken(t, special=False, normalized=False) for t in spec["plain"]])
    tok.chat_template = TEMPLATES[family][0]
    return tok


def save_family_tokenizer(path, family: str, tok=None):
    """Write family_tokenizer(family) (or `tok`, one it made) to `path`, its chat template in
    tokenizer_config.json where the family's model card publishes it (transformers itself writes a
    chat_template.jinja beside it); returns the tokenizer."""
    import json
    from pathlib import Path

    tok = tok if tok is not None else family_tokenizer(family)
    tok.save_pretrained(str(path))
    path = Path(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = tok.chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok


def save_tiny_served_model(path, seed: int = 0, **overrides) -> None:
    """A tiny random model with a tokenizer beside it, so that the coordinator can tokenize and
    detokenize real text for it: the default model's, or for an `arch` of
    tests/family_templates.py (Qwen3, Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE, Qwen2-MoE) the same
    vocabulary with that family's tokens and published chat template (save_family_tokenizer)."""
    from pdserve.common.tokenizer import load_tokenizer
    from tests.family_templates import FAMILY_OF_ARCH

    family = FAMILY_OF_ARCH.get(overrides.get("arch", "llama"))
    tok = load_tokenizer(None) if family is None else family_tokenizer(family)
    cfg = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
               max_position_embeddings=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    cfg.update(overrides)
    save_tiny_model(path, seed=seed, **cfg)
    if family is None:
        tok.save_pretrained(str(path))
    else:
        save_family_tokenizer(path, family, tok)


def pools_of(*pids: int) -> list[str]:
    """The shared KV pool files of these owner pids in this user's pool directory (kvtransfer.pool_files)."""
    import glob

    from pdserve.kvtransfer.pool_files import pool_dir

    return [p for pid in pids for p in glob.glob(os.path.join(pool_dir(), f"kv-{pid}-*"))]


def stream_prompts(n: int) -> list[list[int]]:
    """n distinct prompts of 12, 13, ... token ids: the streams the worker-kill tests run (tests/faults/conftest.py)."""
    return [[100 + 17 * i + j for j in range(12 + i)] for i in range(n)]


def start_cluster(model_dir, log_dir, prefill=1, decode=1, colocated=0, kv_backend="auto", engine_args=(), prefill_args=(),
                  coordinator_args=(), keys=None, timeout=120.0, threads=1, **plan):
    """A coordinator and workers as real processes on loopback; returns the started Launcher.
    threads: each worker's (None: the node's workers share its cores by who is busy, runtime/cores.py).
    `plan` sets further NodePlan fields (e.g. gateway=True, http_port, api_key). The launch's own
    CurveZMQ keys are off unless `launch_keys=True`: many tests speak to the worker port with raw
    sockets (tests/security/test_worker_auth.py checks the launch's keys themselves)."""
    from pdserve.launch import Launcher, NodePlan

    plan.setdefault("launch_keys", False)
    if not any(a.startswith(("--kv-cache-mb", "--num-blocks")) for a in engine_args):
        # the workers' default budget is up to 2 GiB each (reserved in /dev/shm when shared): tests
        # keep the old 512 MiB, which start faster
        engine_args = ["--kv-cache-mb", "512", *engine_args]

    if prefill and not any(a == "--paths" or a.startswith("--paths=") for a in coordinator_args):
        # a pair's hand-off is what these clusters exercise: they pin it (the default, auto, prefills
        # short prompts on the decode worker); tests of the path choice pass --paths themselves
        coordinator_args = ["--paths", "remote", *coordinator_args]
    plan = NodePlan(
        prefill=prefill, decode=decode, colocated=colocated, model=str(model_dir), kv_backend=kv_backend,
        client_addr=f"tcp://127.0.0.1:{free_port()}", worker_addr=f"tcp://127.0.0.1:{free_port()}",
        engine_args=list(engine_args), prefill_args=list(prefill_args), coordinator_args=list(coordinator_args), threads=threads, name="t",
        keys=None if keys is None else str(keys), **plan,
    )
    launcher = Launcher(plan, log_dir=str(log_dir))
    launcher.start()
    try:
        launcher.wait_ready(timeout)
    except BaseException:
        launcher.stop()
        raise
    return launcher


def run_until_blocks_free(launcher, generate) -> tuple:
    """(what generate(client address) returns, the coordinator's stats once every worker's blocks
    are free again: wait_all_blocks_free); the launcher is stopped either way."""
    import asyncio

    from pdserve_client.library import Client

    try:
        results = asyncio.run(generate(launcher.plan.client_addr))
        with Client(launcher.plan.client_addr) as c:
            return results, wait_all_blocks_free(c)
    finally:
        launcher.stop()


def wait_all_blocks_free(client, timeout: float = 5.0) -> dict:
    """Poll the coordinator's stats until every worker reports all its KV blocks free in a
    heartbeat sent after this call began: the second one counted from now (the first may have
    left before the work ended; a quick run can finish between two heartbeats)."""
    import time

    deadline = time.monotonic() + timeout
    first = {w["id"]: w["heartbeats"] for w in client.stats()["workers"]}
    while True:
        stats = client.stats()
        fresh = all(w["heartbeats"] >= first.get(w["id"], 0) + 2 for w in stats["workers"])
        if fresh and all(w["free_blocks"] == w["total_blocks"] and w["running"] == 0 for w in stats["workers"]):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held: {[(w['id'], w['free_blocks'], w['total_blocks'], w['running']) for w in stats['workers']]}")
        time.sleep(0.05)


class FakeLink:
    """A worker's link to the coordinator without a coordinator: the test puts messages in
    `inbox` and reads what the worker sent from `sent`."""

    def __init__(self):
        self.inbox: list = []
        self.sent: list = []
        self.bad_messages = self.dropped = 0
        self.heartbeat = None

    def start(self, heartbeat=None):
        self.heartbeat = heartbeat

    def stop(self):
        pass

    def send(self, msg):
        self.sent.append(msg)

    def drain(self, timeout):
        items, self.inbox = self.inbox, []
        return items

    def taken(self, kind) -> list:
        """The messages of one type sent so far."""
        return [m for m in self.sent if isinstance(m, kind)]


def force_colliding_keys(monkeypatch) -> bytes:
    """Make every prefix-cache block key the same (what a forged collision would be) in the block
    manager and in sequences; returns that key."""
    from pdserve.runtime import kv_cache, sequence

    key = b"k" * 16

    def chain_hashes(tokens, block_size, secret, upto_blocks=None, known=None, salt=None):
        n = len(tokens) // block_size
        return [key] * (n if upto_blocks is None else min(upto_blocks, n))

    monkeypatch.setattr(kv_cache, "chain_hashes", chain_hashes)
    monkeypatch.setattr(sequence, "chain_hashes", chain_hashes)
    return key


def tiny_engine(model_dir, prefill_only: bool = False, **config):
    """(engine, its KV pool) on a tiny checkpoint, as a worker builds them; config: EngineConfig fields."""
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine, build_model
    from pdserve.runtime.kv_cache import allocate_kv_cache
    from pdserve.runtime.weights import load_checkpoint

    econf = EngineConfig(**{"num_blocks": 64, "block_size": 8, **config})
    cfg, tensors = load_checkpoint(str(model_dir), progress=False)
    pool = allocate_kv_cache(cfg, econf.blocks_for_budget(cfg), econf.block_size, econf.kv_torch_dtype, econf.device)
    return LLMEngine(build_model(cfg, tensors, econf), None, econf, kv_cache=pool, prefill_only=prefill_only), pool


def _call_in_module(test_file: str, call: str) -> str:
    """Python source that loads test_file as a module (this checkout importable) and runs m.<call>."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    return (
        "import importlib.util, sys; sys.path.insert(0, %r);"
        "spec = importlib.util.spec_from_file_location('child_of_test', %r);"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m.%s"
    ) % (str(repo), test_file, call)


def run_native_cuda_check(test_file: str, timeout: float = 900) -> None:
    """Run `native_cuda_check()` of a test module in a fresh interpreter with Triton compiling for
    CUDA (TRITON_INTERPRET=0: this process already imported Triton in interpreter mode)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", _call_in_module(test_file, "native_cuda_check()")], check=True, cwd=repo,
                   env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=timeout)


def run_in_child(test_file: str, fn: str, *args):
    """fn(*args) (strings) of a test module in a process of its own, its stdout piped: GPU tests'
    second process (a CUDA IPC peer), or one NCCL's watchdog may abort without taking pytest along."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    return subprocess.Popen([sys.executable, "-c", _call_in_module(test_file, f"{fn}(*sys.argv[1:])"), *map(str, args)],
                            cwd=repo, stdout=subprocess.PIPE, text=True)


def receive_handoff(receiver, timeout: float):
    """Poll a KVReceiver until a KVReady arrives; copy its blocks in and return it (None: none came in time)."""
    import time

    from pdserve.wire.protocol import KVReady

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if receiver.sock.poll(100):
            got = receiver.recv()
            if got is not None and isinstance(got[0], KVReady):
                receiver.copy_in(*got)
                return got[0]
    return None
