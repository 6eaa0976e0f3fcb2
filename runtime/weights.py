"""Weight loading: a GGUF file or a HF checkpoint directory -> (ModelConfig, HF-named tensors).

Lifecycle: `load_checkpoint(path)` reads everything it needs, checks it, and returns plain
float tensors named as in transformers' Llama (`model.layers.0.self_attn.q_proj.weight`, ...;
Qwen3's `self_attn.q_norm` / `k_norm` too, from a GGUF's `attn_q_norm` / `attn_k_norm`;
Phi-3's fused `qkv_proj` / `gate_up_proj`, a GGUF's `attn_qkv` / fused `ffn_up`, are split
into q/k/v and gate/up rows at load by `split_fused`, so nothing after the loader sees them;
Gemma's norm weights w come back as the 1 + w they scale by, `add_one_to_norms`, as a Gemma
GGUF stores them, and its post_attention_norm / ffn_norm / post_ffw_norm as HF's four norms);
on any problem it raises one typed error before anything is handed to a model, so there is no
half-loaded state. GGUF tensors are dequantized here to float32, in every type the installed
`gguf` package can dequantize (F32, F16, BF16, Q4_0...Q8_0, the K-quants, the I-quants, TQ, MXFP4;
found by trying one zero block of each type a file holds), and the llama.cpp Q/K row
permutation is undone. With keep_quantized, the kernels.quant.QTYPES matrices stay in their blocks
(kernels.quant.QuantTensor) for the quantized linear layers; `dequantize_all` is their twin. The default model is located on disk without
importing the package that ships it.
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
from pdserve.kernels.quant import QTYPES, QuantTensor
from pdserve.runtime.config import ModelConfig, RopeScaling

GGUF_ARCHES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

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
# Gemma 2 / 3's four norms a layer (llama.cpp's names): ffn_norm is the MLP's input norm there
_GGUF_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
_SANDWICH = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


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
    """Replace, in place, each layer's fused Phi-3 matrices by their parts: `self_attn.qkv_proj`
    (q, k, v rows stacked, as transformers' Phi3Attention slices them) -> q/k/v_proj, and
    `mlp.gate_up_proj` (gate rows then up rows: Phi3MLP's chunk(2)) -> gate/up_proj. Rows are
    independent, so a QuantTensor splits by taking rows. Other architectures pass unchanged."""
    if cfg.architecture != "Phi3ForCausalLM":
        return
    parts = {"self_attn.qkv_proj": (("self_attn.q_proj", cfg.q_size), ("self_attn.k_proj", cfg.kv_size), ("self_attn.v_proj", cfg.kv_size)),
             "mlp.gate_up_proj": (("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size))}
    for i in range(cfg.num_layers):
        for fused, split in parts.items():
            name = f"model.layers.{i}.{fused}.weight"
            if name not in tensors:
                continue  # _check_names reports the missing parts
            w, start = tensors.pop(name), 0
            if w.shape[0] != sum(rows for _, rows in split):
                raise ModelLoadError(f"{where}: {name} has {w.shape[0]} rows, expected {sum(rows for _, rows in split)}")
            for part, rows in split:
                tensors[f"model.layers.{i}.{part}.weight"] = _rows(w, start, start + rows)
                start += rows


def _rows(w, start: int, stop: int):
    if isinstance(w, QuantTensor):
        return w.take_rows(torch.arange(start, stop))
    return w[start:stop].clone()


def _check_names(cfg: ModelConfig, tensors: dict, where: str) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_layers):
        need += [f"model.layers.{i}.{n}.weight" for n in _GGUF_BLOCK_NAMES.values() if cfg.qk_norm or n not in _QK_NORMS]
        need += [f"model.layers.{i}.{n}.weight" for n in _SANDWICH if cfg.sandwich_norms]
    if not cfg.tie_embeddings:
        need.append("lm_head.weight")
    missing = [n for n in need if n not in tensors]
    if missing:
        raise ModelLoadError(f"{where} lacks {len(missing)} tensor(s), e.g. {missing[0]}")


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
    cfg = _gguf_config(meta, {t.name for t in infos})
    bad = sorted({t.qtype.name for t in infos if not gguf_dequantizable(t.qtype)})
    if bad:
        raise UnsupportedModelError(f"{path.name}: unsupported GGUF tensor type(s) {', '.join(bad)}: the installed gguf package "
                                    f"{gguf_version()} cannot dequantize them (supported: {', '.join(supported_gguf_types())})")
    tensors = {}
    for t in tqdm(infos, desc="loading weights", unit="tensor", disable=not progress):
        name = _gguf_name(t.name, meta.get("general.architecture"))
        if keep_quantized and t.qtype.name in QTYPES and len(t.shape) == 2:
            tensors[name] = _quant_tensor(t, name, cfg)
            continue
        try:
            arr = gguf.quants.dequantize(t.data, t.qtype).reshape(tuple(reversed(t.shape)))
        except Exception as e:
            raise ModelLoadError(f"cannot dequantize {t.name} in {path.name}: truncated or corrupt GGUF ({e})") from e
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # F32 tensors are read-only file maps
        if cfg.architecture == "LlamaForCausalLM" and ("self_attn.q_proj" in name or "self_attn.k_proj" in name):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            w = unpermute_qk(w, heads)
        tensors[name] = w
    split_fused(cfg, tensors, path.name)
    _check_names(cfg, tensors, path.name)
    return cfg, tensors


def _quant_tensor(t, name: str, cfg: ModelConfig) -> QuantTensor:
    qt = QuantTensor(torch.from_numpy(np.array(t.data)), t.qtype.name, (t.data.shape[0], t.shape[0]))  # copied out of the file map
    if cfg.architecture == "LlamaForCausalLM" and ("self_attn.q_proj" in name or "self_attn.k_proj" in name):
        heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
        qt = qt.take_rows(unpermute_qk(torch.arange(qt.shape[0]).unsqueeze(1), heads).squeeze(1))  # rows are independent
    return qt


def dequantize_all(tensors: dict) -> dict[str, torch.Tensor]:
    """Every QuantTensor of a loaded checkpoint as float32 (the `--quantization none` model)."""
    return {k: v.dequantize() if isinstance(v, QuantTensor) else v for k, v in tensors.items()}


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
    block_names = {**_GGUF_BLOCK_NAMES, **_GGUF_PHI3_NAMES} if arch == "phi3" else _GGUF_BLOCK_NAMES
    if arch in ("gemma2", "gemma3"):
        block_names = {**_GGUF_BLOCK_NAMES, **_GGUF_GEMMA_NAMES}
    if m and m.group(2) in block_names:
        return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"
    if name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        raise UnsupportedModelError("GGUF rope_factors_long / rope_factors_short (Phi-3 128k longrope) are not supported; "
                                    "only the default rope (Phi-3 4k variants) is")
    if name == "rope_freqs.weight":
        raise UnsupportedModelError("GGUF rope_freqs (llama3 rope factors stored as a tensor) is not supported; load the HF checkpoint instead")
    raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")


def _gguf_config(meta: dict, names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHES:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHES)})")

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
    scaling = meta.get(f"{arch}.rope.scaling.type")
    rope = RopeScaling(kind=scaling, factor=float(get("rope.scaling.factor"))) if scaling and scaling != "none" else RopeScaling()
    eos = meta.get("tokenizer.ggml.eos_token_id")
    gemma = _gguf_gemma(arch, meta, hidden, heads, head_dim, int(get("block_count")), rope) if arch in ("gemma2", "gemma3") else {}
    return ModelConfig(
        architecture=GGUF_ARCHES[arch],
        vocab_size=int(meta.get(f"{arch}.vocab_size") or 0) or _gguf_vocab(names, meta),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position=int(get("context_length")),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope,
        attention_bias="blk.0.attn_q.bias" in names,
        tie_embeddings="output.weight" not in names,
        qk_norm=arch in ("qwen3", "gemma3"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        **gemma,
    )


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


def _gguf_vocab(names, meta) -> int:
    raise ModelLoadError("GGUF metadata lacks the vocabulary size")
