"""`vllm serve`'s engine flags on `pdserve launch`: --dtype, --max-model-len, --max-num-seqs,
--max-num-batched-tokens, --kv-cache-mb, --gpu-memory-utilization, --block-size, --device,
--quantization, --quant-activations, --linear-backend, --tensor-parallel-size, --pipeline-parallel-size (only 1)
and the switch --no-prefix-cache go to every worker; --served-model-name goes to
the HTTP gateway.

Lifecycle: `engine_flag_options` adds the flags to the click command (each defaults to None:
"not given", so a worker keeps its own default and a cluster TOML's value stands); at launch
`worker_args()` checks the given values by building an `EngineConfig` from them (a bad value
is a usage error before any process starts; without flags it imports nothing, so a plain launch
starts as fast as before) and returns them as worker command-line
arguments, appended after the TOML's so the command line wins. `--engine-arg` stays for the
rest of the worker flags.
"""
from __future__ import annotations

import click

# kernels.backends names, written here so that the launcher's --help imports no torch (tests check they agree)
LINEAR_BACKEND_CHOICES = ["auto", "auto-reduced", "rules", "c", "onednn", "mkl", "onednn-bf16", "int8pack",
                          "c-float", "c-int16", "c-int8", "dequant-mkl", "int4pack"]
LINEAR_BACKEND_HELP = ("CPU: which back-end multiplies each linear layer. auto: the fastest of the float32-faithful ones, measured "
                       "per shape and row count at first start (cached); auto-reduced: bf16 / int8 ones too where they pass a "
                       "teacher-forced accuracy check; rules: fixed row-count rules; or one back-end by name")

# flag (as vllm serve spells it, and as the worker commands take it) -> (click type, help)
WORKER_FLAGS = {
    "dtype": (click.Choice(["auto", "float32", "bfloat16", "float16"]), "weights and KV dtype (auto: bfloat16 on CUDA, float32 on the CPU)"),
    "device": (str, "cpu, cuda or cuda:N"),
    "max_model_len": (int, "context length, prompt + output (default: the model's)"),
    "max_num_seqs": (int, "sequences one worker runs at once"),
    "max_num_batched_tokens": (int, "token budget of one step"),
    "kv_cache_mb": (int, "KV pool memory budget per worker, MiB"),
    "gpu_memory_utilization": (float, "CUDA only: size the KV pool so that this share of the GPU's memory is used"),
    "block_size": (int, "tokens per KV block (a power of two)"),
    "quantization": (click.Choice(["auto", "none"]), "auto: serve a GGUF's Q4_0/Q4_1/Q8_0 weights as they are (CPU); none: dequantize to float32"),
    "quant_activations": (click.Choice(["int16", "float", "int8"]), "quantized weights: how a small decode batch is multiplied (default int16)"),
    "tensor_parallel_size": (click.IntRange(1), "rank processes each worker splits the model over (CPU: gloo); --prefill-tp / --decode-tp per side"),
    "pipeline_parallel_size": (click.IntRange(1), "only 1: pipeline parallelism is not supported"),
    "linear_backend": (click.Choice(LINEAR_BACKEND_CHOICES), LINEAR_BACKEND_HELP + " [default: auto]"),
}

WORKER_SWITCHES = {"no_prefix_cache": "do not reuse the KV of token prefixes computed before (on by default, as in vLLM)"}


def engine_flag_options(f):
    """Decorate a click command with the worker flags and --served-model-name."""
    for name, text in WORKER_SWITCHES.items():
        f = click.option(f"--{name.replace('_', '-')}", name, is_flag=True, default=None, help=text)(f)
    f = click.option("--served-model-name", default=None, help="the model name the HTTP API answers to (default: the file or directory name)")(f)
    for name, (kind, text) in reversed(WORKER_FLAGS.items()):
        f = click.option(f"--{name.replace('_', '-')}", name, default=None, type=kind, help=text)(f)
    return f


def worker_args(values: dict) -> list[str]:
    """The given worker flags as command-line arguments, checked; raises click.BadParameter.
    Without any, nothing is imported: the check needs torch, seconds of the launcher's start."""
    switches = [f"--{k.replace('_', '-')}" for k in WORKER_SWITCHES if values.get(k)]
    given = {k: v for k, v in values.items() if k in WORKER_FLAGS and v is not None}
    if not given:
        return switches
    from runtime.config import EngineConfig
    from pdserve_client.errors import PdserveError

    fields = {("kv_cache_bytes" if k == "kv_cache_mb" else k): (v * 2**20 if k == "kv_cache_mb" else v) for k, v in given.items()}
    try:
        EngineConfig(**fields)
    except PdserveError as e:
        raise click.BadParameter(str(e)) from e
    return [a for k, v in given.items() for a in (f"--{k.replace('_', '-')}", str(v))] + switches
