"""One place builds a model: every path (an engine's `LLMEngine.load`, a worker's TP 1 load, each
rank of a tensor-parallel worker) calls `build_model` (or `load_model`, which reads the checkpoint first).

Lifecycle: called once per process at start, after the checkpoint's tensors are loaded
(runtime.weights.load_checkpoint). It refuses, before anything is built, an attention option the
backend lacks (`check_attention_backend`); decides which GGUF blocks stay blocks
(`_as_served`: on the CPU fast path all of them; on CUDA those the Triton weight-only kernel
takes at TP 1, none under TP; elsewhere none, with a log line saying why); then builds either
runtime.model's `LlamaModel` (TP 1: its modules, then the fused CPU path where it runs, and the
linear back-end plan of runtime.linear_plan) or, given a rank group of more than one rank, that
rank's runtime.tp_model `TPModel` over its shard (runtime.tp.shard). Both run the one decoder
layer of runtime.layer.
"""
from __future__ import annotations

import importlib.util
import logging

from pdserve.common.errors import NotSupportedError
from pdserve.kernels import cpu_native
from pdserve.kernels.quant import TRITON_QTYPES, QuantExperts, QuantTensor
from pdserve.runtime import linear_plan
from pdserve.runtime.config import EngineConfig, ModelConfig
from pdserve.runtime.model import LlamaModel
from pdserve.runtime.tp import shard
from pdserve.runtime.tp_model import TPModel
from pdserve.runtime.weights import dequantize_all, load_checkpoint

log = logging.getLogger("pdserve.runtime")


def build_model(cfg: ModelConfig, tensors: dict, econf: EngineConfig, source=None, group=None) -> LlamaModel | TPModel:
    """The model from loaded tensors: TP 1's LlamaModel, or with `group` (a runtime.tp.RankGroup of
    more than one rank) this rank's TPModel from the whole checkpoint's tensors (the caller drops
    the rest). Quantized tensors (kernels.quant.QuantTensor) stay quantized where they can be
    served so, else are dequantized (`_as_served`). TP 1's linear layers' back-ends follow
    econf.linear_backend (runtime.linear_plan; source, the checkpoint's path or None for the
    default model, names the tokenizer its accuracy check reads)."""
    check_attention_backend(cfg, econf)
    if group is not None and group.size > 1:
        return TPModel(cfg, _as_served(shard(cfg, tensors, group.rank, group.size), econf, tp=True), econf, group)
    model = LlamaModel(cfg, econf.torch_dtype, econf.attention_backend)
    model.load_weights(_as_served(tensors, econf, tp=False))
    model = model.to(econf.device).eval()
    if econf.fast_path and econf.attention_backend in ("auto", "torch"):
        model.enable_fast_path(econf.linear_kind, econf.quant_activations)
        linear_plan.apply(model, econf, source)
    if model.quantized and model.fast is None and not econf.device.startswith("cuda"):
        raise RuntimeError("the quantized weights need the CPU fast path, which did not start")
    kinds = f"{len(model.quantized)} matrices in {'/'.join(sorted({q.qtype for q in model.quantized.values()}))}" if model.quantized else econf.dtype
    log.info("weights: %.1f MiB (%s)", model.weight_bytes() / 2**20, kinds)
    return model


def load_model(model=None, config: EngineConfig | None = None, progress: bool = False) -> tuple[ModelConfig, LlamaModel]:
    """Read a checkpoint and build its model (TP 1) as `config` says (quantized or not)."""
    config = config or EngineConfig()
    cfg, tensors = load_checkpoint(model, progress=progress, keep_quantized=config.keep_quantized)
    return cfg, build_model(cfg, tensors, config, model)


def _as_served(tensors: dict, econf: EngineConfig, tp: bool) -> dict:
    """The tensors with every quantized one the path cannot serve in its blocks dequantized:
    all where quantized weights cannot be served here (`_why_not_quantized`, logged), under TP on
    CUDA all (the Triton block kernel is TP 1's), at TP 1 on CUDA those Triton does not take."""
    quantized = sorted({v.qtype for v in tensors.values() if isinstance(v, (QuantTensor, QuantExperts))})
    if not quantized:
        return tensors
    why_not = _why_not_quantized(econf) or ("tensor parallelism on CUDA runs float weights" if tp and econf.device.startswith("cuda") else None)
    if why_not:
        log.warning("quantization auto: %s, so the %s weights are dequantized to %s", why_not, "/".join(quantized), econf.dtype)
        return dequantize_all(tensors)
    untaken = sorted(set(quantized) - set(TRITON_QTYPES)) if econf.device.startswith("cuda") else []
    if untaken:
        log.info("quantization auto: the CUDA weight-only kernel takes %s, so the %s weights are dequantized to %s",
                 "/".join(TRITON_QTYPES), "/".join(untaken), econf.dtype)
        return {k: v.dequantize() if isinstance(v, (QuantTensor, QuantExperts)) and v.qtype in untaken else v for k, v in tensors.items()}
    return tensors


def check_attention_backend(cfg: ModelConfig, econf: EngineConfig) -> None:
    """Refuse, before a model is built, an attention option the backend this engine would run
    lacks: attention soft-capping (Gemma 2) on CUDA, where attention is Triton's
    (kernels.paged refuses it there too, per call)."""
    backend = econf.attention_backend
    if cfg.attn_softcap and backend in ("auto", "triton") and (backend == "triton" or econf.device.startswith("cuda")):
        raise NotSupportedError(f"{cfg.architecture}: attention logit soft-capping ({cfg.attn_softcap:g}) is not supported by the "
                                "Triton attention kernel that serves CUDA devices; serve this model on the CPU (--device cpu)")


def _why_not_quantized(econf: EngineConfig) -> str | None:
    """None where quantized weights can be served as they are; else the reason they cannot."""
    if econf.quantization == "none":
        return "off (--quantization none)"
    if econf.device.startswith("cuda"):
        return None if importlib.util.find_spec("triton") is not None else "Triton is not installed (the CUDA weight-only kernel is Triton)"
    if not econf.device.startswith("cpu"):
        return f"not supported on {econf.device}"
    if econf.dtype != "float32" or not econf.fast_path or econf.attention_backend not in ("auto", "torch"):
        return "it runs on the float32 CPU fast path only"
    if cpu_native.native() is None:
        return "the C kernels could not be built"
    return None
