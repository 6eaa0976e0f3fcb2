"""Weight loading: a GGUF file or a HF checkpoint directory -> (ModelConfig, HF-named tensors).

Lifecycle: `load_checkpoint(path)` reads everything it needs, checks it, and returns plain
float tensors named as in transformers' Llama (`model.layers.0.self_attn.q_proj.weight`, ...;
Qwen3's `self_attn.q_norm` / `k_norm` too, from a GGUF's `attn_q_norm` / `attn_k_norm`;
Phi-3's fused `qkv_proj` / `gate_up_proj`, a GGUF's `attn_qkv` / fused `ffn_up` (and any
family's attn_qkv from convert_hf_to_gguf.py --fuse-qkv), are split into q/k/v and gate/up rows
at load by `split_fused`, before the llama arch's Q/K rows are un-permuted, so nothing after the loader sees them;
Gemma's norm weights w come back as the 1 + w they scale by, `add_one_to_norms`, as a Gemma
GGUF stores them, and its post_attention_norm / ffn_norm / post_ffw_norm as HF's four norms; a mixture of experts'
matrices as one 3-D stack each, `mlp.experts.gate_proj` / `up_proj` / `down_proj` (`stack_experts`
from HF's per-expert or fused names, or a GGUF's ffn_*_exps, whose quantized stacks are
dequantized here unless keep_quantized: then kernels.quant.QuantExperts, every expert's blocks),
the router as `mlp.gate.weight`);
A GGUF's config comes from its metadata as llama.cpp reads it (rope scaling from rope.scaling.*,
`_gguf_rope`; the vocabulary size from token_embd's rows where {arch}.vocab_size is absent);
on any problem it raises one typed error before anything is handed to a model, so there is no
half-loaded state. GGUF tensors are dequantized here to float32, in every type the installed
`gguf` package can dequantize (F32, F16, BF16, Q4_0...Q8_0, the K-quants, the I-quants, TQ, MXFP4;
found by trying one zero block of each type a file holds), and the llama.cpp Q/K row
permutation is undone. The vocabulary size is {arch}.vocab_size where written (llama.cpp's
convert_hf_to_gguf.py writes it for the llama arch only), else token_embd's row count.
tests/runtime/test_llamacpp_gguf.py loads every family as that converter writes it. With keep_quantized, the kernels.quant.QTYPES matrices stay in their blocks
(kernels.quant.QuantTensor) for the quantized linear layers, and the 3-D expert stacks in
theirs (kernels.quant.QuantExperts, served expert by expert: runtime.moe); `dequantize_all` is their twin. The default model is located on disk without
importing the package that ships it.
Those blocks are read-only views of the GGUF's file map (shared by every process of the node
that maps the file), each with an origin in the node's weight cache (runtime.weight_cache), so
that what is made of them (the Q/K rows un-permuted here, q/k/v and gate/up joined by the model,
the kernels' 16-row GEMV copies) is made once per node into a file every worker maps; a fused
matrix split here is split into views. With the cache off (PDSERVE_WEIGHT_CACHE=off, or a cache
directory that cannot be used) each process copies the blocks out of the map, as before: the twin.
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pdserve.common.errors import ModelLoadError, UnsupportedModelError
from pdserve.common.model_path import default_model_path, resolve_model_path  # noqa: F401  (re-exported)
from pdserve.kernels.quant import QTYPES, Origin, QuantExperts, QuantTensor
from pdserve.runtime.config import ModelConfig, RopeScaling
from pdserve.runtime.weight_cache import WeightCache, readonly_tensor

GGUF_ARCHES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
               "qwen3moe": "Qwen3MoeForCausalLM"}  # llama with expert_count: Mixtral

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3 (llama.cpp's convert_hf_to_gguf names)
    "attn_k_norm": "self_attn.k_norm",
}
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
# Phi-3's fused matrices (HF names), split at load; a phi3 GGUF's ffn_up is the fused gate_up
_GGUF_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GGUF_QKV = {"attn_qkv": "self_attn.qkv_proj"}  # any family converted with convert_hf_to_gguf.py --fuse-qkv
# Gemma 2 / 3's four norms a layer (llama.cpp's names): ffn_norm is the MLP's input norm there
_GGUF_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
_SANDWICH = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
# mixture of experts (llama.cpp's names): the router, the experts' 3-D stacks (no .weight in ours),
# Qwen2-MoE's shared expert and its gate
_GGUF_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                   "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_GGUF_EXPERT_STACKS = {"ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
_DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def load_checkpoint(model: str | os.PathLike | None, progress: bool = True,
                    keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantTensor]]:
    """keep_quantized: a GGUF's kernels.quant.QTYPES matrices come back as kernels.quant.QuantTensor
    (their blocks as stored, Q/K rows un-permuted) instead of float32; everything else as before."""
    path = resolve_model_path(model)
    if path.is_dir():
        return _load_hf_dir(path, progress)
    if path.suffix != ".gguf" and not _has_gguf_magic(path):
        raise ModelLoadError(f"{path} is neither a GGUF file nor a checkpoint directory")
    return _load_gguf(path, progress, keep_quantized)


# ---------------------------------------------------------------- HF directory (safetensors)

def _load_hf_dir(path: Path, progress: bool):
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json")
    try:
        cfg = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    except (KeyError, ValueError, TypeError) as e:
        if isinstance(e, UnsupportedModelError):
            raise
        raise ModelLoadError(f"{cfg_file} is not a valid model config: {e!r}") from e
    files = _safetensors_files(path)
    from safetensors import safe_open

    tensors = {}
    for f in tqdm(files, desc="loading weights", unit="file", disable=not progress):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    tensors[name] = st.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"cannot read {f}: truncated or corrupt safetensors ({e})") from e
    split_fused(cfg, tensors, str(path))
    stack_experts(cfg, tensors, str(path))
    _check_names(cfg, tensors, str(path))
    if cfg.norm_plus_one:
        add_one_to_norms(tensors)
    return cfg, tensors


def add_one_to_norms(tensors: dict) -> None:
    """Gemma's RMSNorm weights w as the (1 + w) it multiplies by, in float32 (transformers' Gemma
    RMSNorm computes 1.0 + w.float()), in place: what llama.cpp's converter stores in a Gemma
    GGUF, so both loaders hand the model the same tensors."""
    for name in [n for n in tensors if n.endswith("norm.weight")]:
        tensors[name] = 1.0 + tensors[name].float()


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = list(path.glob("*.bin")) + list(path.glob("*.pt"))
        why = " (pickled .bin/.pt weights are refused; convert them to safetensors)" if bins else ""
        raise ModelLoadError(f"{path} has no *.safetensors weights{why}")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"weight shard missing: {missing[0]}")
    return files


def split_fused(cfg: ModelConfig, tensors: dict, where: str) -> None:
    """Replace, in place, each layer's fused matrices by their parts: `self_attn.qkv_proj` (q, k, v
    rows stacked, as transformers' Phi3Attention slices them; any family's GGUF written with
    convert_hf_to_gguf.py --fuse-qkv, its bias too) -> q/k/v_proj, and Phi-3's `mlp.gate_up_proj`
    (gate rows then up rows: Phi3MLP's chunk(2)) -> gate/up_proj. Rows are independent, so a
    QuantTensor splits by taking rows. Checkpoints without them pass unchanged."""
    parts = {"self_attn.qkv_proj": (("self_attn.q_proj", cfg.q_size), ("self_attn.k_proj", cfg.kv_size), ("self_attn.v_proj", cfg.kv_size))}
    if cfg.architecture == "Phi3ForCausalLM":
        parts["mlp.gate_up_proj"] = (("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size))
    for i in range(cfg.num_layers):
        for fused, split in parts.items():
            for kind in ("weight", "bias"):
                name = f"model.layers.{i}.{fused}.{kind}"
                if name not in tensors:
                    continue  # _check_names reports the missing parts
                w, start = tensors.pop(name), 0
                if w.shape[0] != sum(rows for _, rows in split):
                    raise ModelLoadError(f"{where}: {name} has {w.shape[0]} rows, expected {sum(rows for _, rows in split)}")
                for part, rows in split:
                    tensors[f"model.layers.{i}.{part}.{kind}"] = _rows(w, start, start + rows)
                    start += rows


def stack_experts(cfg: ModelConfig, tensors: dict, where: str) -> None:
    """A MoE checkpoint's experts as one stack per matrix, in place: `model.layers.N.mlp.experts.
    gate_proj` / `up_proj` (E, I, hidden) and `down_proj` (E, hidden, I), the router as
    `mlp.gate.weight`. Read from the per-expert names HF writes (Mixtral's `block_sparse_moe.
    experts.{e}.w1` / `w3` / `w2`, Qwen's `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`) or
    from transformers 5's fused 3-D parameters (`experts.gate_up_proj` (E, 2 I, hidden): gate rows
    then up rows, as its experts chunk them; `experts.down_proj`). Dense models pass unchanged."""
    if not cfg.num_experts:
        return
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for old in [n for n in tensors if n.startswith(p + "block_sparse_moe.")]:  # Mixtral's module name
            tensors[p + "mlp." + old[len(p + "block_sparse_moe."):]] = tensors.pop(old)
        if not cfg.moe(i):
            continue
        e = p + "mlp.experts."
        fused = tensors.pop(e + "gate_up_proj", None)
        if fused is not None:
            if tuple(fused.shape) != (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size):
                raise ModelLoadError(f"{where}: {e}gate_up_proj has shape {tuple(fused.shape)}, expected "
                                     f"{(cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)}")
            tensors[e + "gate_proj"], tensors[e + "up_proj"] = fused.chunk(2, dim=1)
        for ours, names in (("gate_proj", ("gate_proj", "w1")), ("up_proj", ("up_proj", "w3")), ("down_proj", ("down_proj", "w2"))):
            if e + ours in tensors:
                continue
            per = [next((tensors.pop(f"{e}{x}.{n}.weight") for n in names if f"{e}{x}.{n}.weight" in tensors), None)
                   for x in range(cfg.num_experts)]
            if any(w is None for w in per):
                raise ModelLoadError(f"{where} lacks expert {per.index(None)}'s {ours} in layer {i} ({cfg.num_experts} experts)")
            tensors[e + ours] = torch.stack([w.dequantize() if isinstance(w, QuantTensor) else w for w in per])
        extra = [n for n in tensors if n.startswith(e) and n[len(e):].split(".")[0].isdigit()]
        if extra:
            raise ModelLoadError(f"{where}: {extra[0]} names an expert beyond the config's {cfg.num_experts}")


def _rows(w, start: int, stop: int):
    if isinstance(w, QuantTensor):
        return w.row_slice(start, stop)  # a view: the model joins q/k/v back into a view of the fused matrix
    return w[start:stop].clone()


def _check_names(cfg: ModelConfig, tensors: dict, where: str) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    shapes = {}  # MoE tensors: the shape the config implies
    for i in range(cfg.num_layers):
        moe = cfg.moe(i)
        need += [f"model.layers.{i}.{n}.weight" for n in _GGUF_BLOCK_NAMES.values()
                 if (cfg.qk_norm or n not in _QK_NORMS) and not (moe and n in _DENSE_MLP)]
        need += [f"model.layers.{i}.{n}.weight" for n in _SANDWICH if cfg.sandwich_norms]
        if moe:
            p, e, m, h = f"model.layers.{i}.mlp.", cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
            shapes.update({p + "gate.weight": (e, h), p + "experts.gate_proj": (e, m, h), p + "experts.up_proj": (e, m, h),
                           p + "experts.down_proj": (e, h, m)})
            if cfg.shared_expert_intermediate_size:
                s = cfg.shared_expert_intermediate_size
                shapes.update({p + "shared_expert.gate_proj.weight": (s, h), p + "shared_expert.up_proj.weight": (s, h),
                               p + "shared_expert.down_proj.weight": (h, s), p + "shared_expert_gate.weight": (1, h)})
    if not cfg.tie_embeddings:
        need.append("lm_head.weight")
    missing = [n for n in [*need, *shapes] if n not in tensors]
    if missing:
        raise ModelLoadError(f"{where} lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    bad = [(n, tuple(tensors[n].shape), want) for n, want in shapes.items() if tuple(tensors[n].shape) != want]
    if bad:
        raise ModelLoadError(f"{where}: {bad[0][0]} has shape {bad[0][1]}, the config implies {bad[0][2]}")


# ---------------------------------------------------------------- GGUF

def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _load_gguf(path: Path, progress: bool, keep_quantized: bool = False):
    import gguf

    from pdserve.common.gguf_file import read_gguf

    if not _has_gguf_magic(path):
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic)")
    try:
        meta, infos = read_gguf(str(path))
    except Exception as e:  # ValueError/struct.error/OSError on a bad file
        raise ModelLoadError(f"cannot read {path}: truncated or corrupt GGUF ({type(e).__name__}: {e})") from e
    cfg = _gguf_config(meta, {t.name: t.shape for t in infos})
    bad = sorted({t.qtype.name for t in infos if not gguf_dequantizable(t.qtype)})
    if bad:
        raise UnsupportedModelError(f"{path.name}: unsupported GGUF tensor type(s) {', '.join(bad)}: the installed gguf package "
                                    f"{gguf_version()} cannot dequantize them (supported: {', '.join(supported_gguf_types())})")
    tensors = {}
    store = WeightCache.for_model(path) if keep_quantized and any(t.qtype.name in QTYPES for t in infos) else None
    for t in tqdm(infos, desc="loading weights", unit="tensor", disable=not progress):
        name = _gguf_name(t.name, meta.get("general.architecture"))
        if keep_quantized and t.qtype.name in QTYPES and len(t.shape) in (2, 3):
            tensors[name] = _file_blocks(t, store)
            continue
        try:
            arr = gguf.quants.dequantize(t.data, t.qtype).reshape(tuple(reversed(t.shape)))
        except Exception as e:
            raise ModelLoadError(f"cannot dequantize {t.name} in {path.name}: truncated or corrupt GGUF ({e})") from e
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # F32 tensors are read-only file maps
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # llama.cpp stores it as a vector (hidden,)
        tensors[name] = w
    split_fused(cfg, tensors, path.name)
    if cfg.architecture in _PERMUTED:  # after the split: a fused attn_qkv (--fuse-qkv) holds the permuted q and k rows
        for name in [n for n in tensors if ".self_attn.q_proj." in n or ".self_attn.k_proj." in n]:
            tensors[name] = _unpermute(tensors[name], cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
    _check_names(cfg, tensors, path.name)
    return cfg, tensors


def _file_blocks(t, store: WeightCache | None) -> QuantTensor | QuantExperts:
    """A quantized GGUF tensor kept in its blocks: a 2-D matrix (rows, cols) as a QuantTensor, a
    3-D expert stack (E, rows, cols) as a QuantExperts. With the node's weight cache (`store`),
    the bytes are a read-only view of the file map, shared by every process that maps the file,
    with an origin (the tensor's name) so that what is made of them is made once per node;
    without it, a private copy."""
    if store is None:
        raw = torch.from_numpy(np.array(t.data))  # copied out of the file map
        origin = None
    else:
        raw = readonly_tensor(t.data)
        origin = Origin(store, t.name)
    if len(t.shape) == 2:
        return QuantTensor(raw, t.qtype.name, (t.data.shape[0], t.shape[0]), origin)
    return QuantExperts(raw.reshape(t.shape[2], t.shape[1], -1), t.qtype.name, (t.shape[2], t.shape[1], t.shape[0]), origin)


def _unpermute(w, heads: int):
    if isinstance(w, QuantTensor):  # rows are independent: take them in the un-permuted order
        return w.take_rows(unpermute_qk(torch.arange(w.shape[0]).unsqueeze(1), heads).squeeze(1))
    return unpermute_qk(w, heads)


_PERMUTED = ("LlamaForCausalLM", "MixtralForCausalLM")  # llama.cpp's llama arch: Q/K rows permuted at conversion


def dequantize_all(tensors: dict) -> dict[str, torch.Tensor]:
    """Every QuantTensor of a loaded checkpoint as float32 (the `--quantization none` model)."""
    return {k: v.dequantize() if isinstance(v, (QuantTensor, QuantExperts)) else v for k, v in tensors.items()}


@functools.cache
def gguf_dequantizable(qtype) -> bool:
    """Whether the installed gguf package dequantizes this tensor type: tried on one zero block."""
    from gguf import GGML_QUANT_SIZES, quants

    if qtype not in GGML_QUANT_SIZES:
        return False
    block, type_size = GGML_QUANT_SIZES[qtype]
    try:
        out = quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError, KeyError):
        return False
    return out.size == block and np.issubdtype(out.dtype, np.floating)


def supported_gguf_types() -> list[str]:
    from gguf import GGMLQuantizationType

    return [t.name for t in GGMLQuantizationType if gguf_dequantizable(t)]


def gguf_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gguf")
    except metadata.PackageNotFoundError:
        return "(unknown version)"


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time Q/K row permutation (interleaved -> half-split RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _gguf_name(name: str, arch: str | None = None) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _GGUF_EXPERT_STACKS and m.group(3) == "weight":  # a 3-D stack (experts, rows, columns)
        return f"model.layers.{m.group(1)}.{_GGUF_EXPERT_STACKS[m.group(2)]}"
    block_names = {**_GGUF_BLOCK_NAMES, **_GGUF_PHI3_NAMES} if arch == "phi3" else {**_GGUF_BLOCK_NAMES, **_GGUF_MOE_NAMES, **_GGUF_QKV}
    if arch in ("gemma2", "gemma3"):
        block_names = {**_GGUF_BLOCK_NAMES, **_GGUF_GEMMA_NAMES, **_GGUF_QKV}
    if m and m.group(2) in block_names:
        return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"
    if name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        raise UnsupportedModelError("GGUF rope_factors_long / rope_factors_short (Phi-3 128k longrope) are not supported; "
                                    "only the default rope (Phi-3 4k variants) is")
    if name == "rope_freqs.weight":
        raise UnsupportedModelError("GGUF rope_freqs (llama3 rope factors stored as a tensor) is not supported; load the HF checkpoint instead")
    raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")


def _gguf_config(meta: dict, shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """The ModelConfig of a GGUF's metadata and tensor table (name -> ggml shape)."""
    names = set(shapes)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHES:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHES)})")
    moe = _gguf_moe(arch, meta, names)

    def get(key, default=None):
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise UnsupportedModelError(f"GGUF {arch}.rope.dimension_count {rotary} differs from head_dim {head_dim}: partial rotary is not supported")
    rope = _gguf_rope(arch, meta, int(get("context_length")))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    gemma = _gguf_gemma(arch, meta, hidden, heads, head_dim, int(get("block_count")), rope) if arch in ("gemma2", "gemma3") else {}
    return ModelConfig(
        architecture="MixtralForCausalLM" if arch == "llama" and moe else GGUF_ARCHES[arch],
        vocab_size=int(meta.get(f"{arch}.vocab_size") or 0) or _gguf_vocab(arch, shapes),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", moe.get("moe_intermediate_size"))),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position=int(get("context_length")),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope,
        attention_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        tie_embeddings="output.weight" not in names,
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        **gemma,
        **moe,
    )


def _gguf_rope(arch: str, meta: dict, context: int) -> RopeScaling:
    """A GGUF's rope scaling, from llama.cpp's rope.scaling.* keys: none, linear (factor) or yarn
    (factor; original_context_length, default the context length as llama.cpp's n_ctx_orig_yarn;
    yarn_beta_fast / yarn_beta_slow and yarn_attn_factor as llama.cpp's converter copies them from
    the HF config's beta_fast / beta_slow / attention_factor, so the file decodes as its source
    checkpoint; yarn_log_multiplier as llama.cpp reads it, mscale_all_dim with mscale 1).
    llama.cpp's yarn_ext_factor (the converter's copy of a config's extrapolation_factor, which
    transformers does not read and llama.cpp reads only for Grok) is ignored. Any other type, or a
    rope.scaling.attn_factor other than 1 (llama.cpp's extra scale of Phi-3's longrope), is refused."""

    def key(name, default=None):
        v = meta.get(f"{arch}.rope.scaling.{name}")
        return default if v is None else v

    factor = key("factor", meta.get(f"{arch}.rope.scale_linear"))  # llama.cpp: the older key where the new one is absent
    kind = key("type", "linear" if factor else "none")  # llama.cpp's default type: linear (a factor of 0 or none: unscaled)
    if float(key("attn_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"GGUF {arch}.rope.scaling.attn_factor {key('attn_factor')} is not supported (only 1)")
    if kind == "none" or (kind == "linear" and factor is not None and not factor):
        return RopeScaling()
    if factor is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.rope.scaling.factor (rope scaling type {kind!r})")
    if kind != "yarn":
        return RopeScaling(kind=kind, factor=float(factor))
    log_mul = float(key("yarn_log_multiplier", 0.0))
    attention = key("yarn_attn_factor")
    return RopeScaling(kind="yarn", factor=float(factor), original_max_position=int(key("original_context_length", context)),
                       beta_fast=float(key("yarn_beta_fast", 0.0)) or 32.0, beta_slow=float(key("yarn_beta_slow", 0.0)) or 1.0,
                       attention_factor=None if attention is None else float(attention),
                       mscale=1.0 if log_mul else 0.0, mscale_all_dim=log_mul)


def _gguf_moe(arch: str, meta: dict, names: set[str]) -> dict:
    """A MoE GGUF's ModelConfig fields, read as llama.cpp reads them: expert_count and
    expert_used_count; the experts' width from expert_feed_forward_length (qwen2moe / qwen3moe;
    llama (Mixtral): feed_forward_length); the shared expert's from expert_shared_feed_forward_length
    (qwen2moe); the top-k weights renormalised as llama.cpp's graphs do (llama and qwen3moe yes,
    qwen2moe no) unless expert_weights_norm says otherwise; dense layers: those without a router
    (ffn_gate_inp)."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not experts:
        if arch in ("qwen2moe", "qwen3moe"):
            raise ModelLoadError(f"GGUF metadata lacks {arch}.expert_count")
        return {}
    if arch not in ("llama", "qwen2moe", "qwen3moe"):
        raise UnsupportedModelError(f"GGUF {arch} with experts ({experts}) is not supported (MoE: llama (Mixtral), qwen2moe, qwen3moe)")
    used = meta.get(f"{arch}.expert_used_count")
    if used is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.expert_used_count")
    width = meta.get(f"{arch}.expert_feed_forward_length" if arch != "llama" else f"{arch}.feed_forward_length")
    if width is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.expert_feed_forward_length")
    layers = int(meta.get(f"{arch}.block_count") or 0)
    norm = meta.get(f"{arch}.expert_weights_norm")
    shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0) if arch == "qwen2moe" else 0
    if arch == "qwen2moe" and not shared:
        raise ModelLoadError("GGUF metadata lacks qwen2moe.expert_shared_feed_forward_length")
    return dict(num_experts=experts, experts_per_tok=int(used), moe_intermediate_size=int(width),
                norm_topk_prob=bool(arch != "qwen2moe" if norm is None else norm), shared_expert_intermediate_size=shared,
                dense_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names))


def _gguf_gemma(arch: str, meta: dict, hidden: int, heads: int, head_dim: int, layers: int, rope: RopeScaling) -> dict:
    """A gemma2 / gemma3 GGUF's Gemma fields, read as llama.cpp reads them: soft-caps from
    metadata (gemma2); the sliding pattern from attention.sliding_window_pattern where written,
    else llama.cpp's fixed one (gemma2 every 2nd layer full, gemma3 every 6th); the sliding layers'
    rope base from rope.freq_base_swa (default 10000); and the attention scale, which a GGUF does
    not carry, by llama.cpp's rule: hidden / heads for the 27B models (46 / 62 layers), else
    head_dim. Its norm weights are stored with the 1 added already (llama.cpp's converter)."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, (list, tuple)):  # one bool per layer: sliding or not
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) if int(pattern) else True for i in range(layers)]
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    if len(sliding) != layers or (any(sliding) and not window):
        raise UnsupportedModelError(f"GGUF {arch}: a sliding-window pattern {pattern!r} for {layers} layers, window {window}, is not supported")
    big = layers == (46 if arch == "gemma2" else 62)
    out = dict(norm_plus_one=True, sandwich_norms=True, embed_scale=float(hidden) ** 0.5, activation="gelu_tanh",
               query_pre_attn_scalar=float(hidden // heads if big else head_dim),
               attn_softcap=float(meta.get(f"{arch}.attn_logit_softcapping") or 0.0),
               final_softcap=float(meta.get(f"{arch}.final_logit_softcapping") or 0.0),
               layer_windows=tuple(window if s else 0 for s in sliding) if any(sliding) else ())
    if arch == "gemma3":
        out["rope_local_theta"] = float(meta.get(f"{arch}.rope.freq_base_swa") or 10000.0)
    return out


def _gguf_vocab(arch: str, shapes: dict[str, tuple[int, ...]]) -> int:
    """The vocabulary size of a GGUF without {arch}.vocab_size (llama.cpp's converter writes it
    only for some architectures): the embedding's rows, as llama.cpp sizes token_embd (ggml shape
    (hidden, vocab)), else the output matrix's."""
    for name in ("token_embd.weight", "output.weight"):
        if len(shapes.get(name, ())) == 2:
            return int(shapes[name][1])
    raise ModelLoadError(f"GGUF metadata lacks {arch}.vocab_size and it has no token_embd / output matrix to take the vocabulary size from")
