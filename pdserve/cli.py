"""The `pdserve` command line. Each sub-command imports its role lazily, so `pdserve --help`
stays fast and the coordinator's commands never import the model code."""
from __future__ import annotations

import json
import logging
import sys
import time

import click

from pdserve.engine_flags import LINEAR_BACKEND_CHOICES, LINEAR_BACKEND_HELP, engine_flag_options, worker_args
from pdserve.launch import HANG_TIMEOUT_S

COORDINATOR_CLIENTS = "tcp://127.0.0.1:5555"
COORDINATOR_WORKERS = "tcp://127.0.0.1:5556"


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _engine_options(f):
    opts = [
        click.option("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)"),
        click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                     help="auto: bfloat16 on CUDA, float32 on the CPU"),
        click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N"),
        click.option("--block-size", default=16, show_default=True, type=int),
        click.option("--kv-cache-mb", default=None, type=int,
                     help="KV pool memory budget (default: 2048, or less on a small machine: at most a quarter of the available "
                          "memory and half of /dev/shm's free space)"),
        click.option("--num-blocks", default=None, type=int, help="KV pool size in blocks (overrides --kv-cache-mb)"),
        click.option("--max-num-seqs", default=64, show_default=True, type=int),
        click.option("--max-num-batched-tokens", "--max-batched-tokens", "max_batched_tokens", default=2048, show_default=True, type=int,
                     help="token budget of one step"),
        click.option("--max-model-len", default=None, type=int, help="context length, prompt + output (default: the model's)"),
        click.option("--gpu-memory-utilization", default=None, type=float,
                     help="CUDA only: size the KV pool so that this share of the GPU's memory is used (instead of --kv-cache-mb)"),
        click.option("--quantization", "-q", default="auto", show_default=True, type=click.Choice(["auto", "none"]),
                     help="auto: serve a GGUF's Q4_0/Q4_1/Q8_0 weights as they are (CPU); none: dequantize to float32"),
        click.option("--quant-activations", default=None, type=click.Choice(["float", "int16", "int8"]),
                     help="quantized weights: how a small decode batch (<= 4 rows; int16: <= 7) is multiplied: float (exact to summation order), "
                          "int16 or int8 (activations rounded per 32-wide block, integer products; faster, approximate) "
                          "[default: the engine's]"),
        click.option("--int8-activations", is_flag=True, help="the same as --quant-activations int8"),
        click.option("--linear-backend", default="auto", show_default=True, type=click.Choice(LINEAR_BACKEND_CHOICES),
                     help=LINEAR_BACKEND_HELP),
        click.option("--no-prefix-cache", "no_prefix_cache", is_flag=True,
                     help="do not reuse the KV of token prefixes computed before (the prefix cache is on by default, as in vLLM)"),
        click.option("--tensor-parallel-size", "-tp", "tensor_parallel_size", default=1, show_default=True, type=click.IntRange(1),
                     help="rank processes the model is split over (CPU: gloo on loopback)"),
        click.option("--pipeline-parallel-size", "-pp", "pipeline_parallel_size", default=1, show_default=True, type=click.IntRange(1),
                     help="only 1: pipeline parallelism is not supported"),
        click.option("--threads", default=None, type=int, help="torch threads (default: torch's choice; with TP n, each rank a 1/n share)"),
        click.option("--core-share", default=None, help="PATH:SLOT from the launcher: share the node's cores with its other busy workers"),
        click.option("--worker-id", default="", help="default: ROLE-PID"),
        click.option("--coordinator", "coordinator_addr", default=COORDINATOR_WORKERS, show_default=True, help="coordinator worker port"),
        click.option("--heartbeat-s", "heartbeat_s", default=0.5, show_default=True, type=float,
                     help="seconds between heartbeats (load, free KV blocks, step times); keep well under the coordinator's --worker-timeout"),
        click.option("-v", "--verbose", is_flag=True),
        _SECRET_OPTION,
    ]
    for o in reversed(opts):
        f = o(f)
    return _security_options(f)


def _configs(model, dtype, device, block_size, kv_cache_mb, num_blocks, max_num_seqs, max_batched_tokens, max_model_len, gpu_memory_utilization,
             quantization, quant_activations, int8_activations, threads, core_share, worker_id, coordinator_addr, no_prefix_cache=False,
             tensor_parallel_size=1, pipeline_parallel_size=1, linear_backend="auto", **extra):
    from runtime.config import EngineConfig, WorkerConfig, auto_kv_cache_mb
    from pdserve_client.errors import PdserveError

    if kv_cache_mb is None:  # not used when --num-blocks or --gpu-memory-utilization sizes the pool
        kv_cache_mb = auto_kv_cache_mb() if num_blocks is None and gpu_memory_utilization is None else 0
    try:
        ecfg = EngineConfig(dtype=dtype, device=device, block_size=block_size, kv_cache_bytes=kv_cache_mb * 2**20, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_batched_tokens, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                            quantization=quantization, prefix_cache=not no_prefix_cache, tensor_parallel_size=tensor_parallel_size,
                            pipeline_parallel_size=pipeline_parallel_size, linear_backend=linear_backend,
                            quant_activations="int8" if int8_activations else quant_activations or EngineConfig.quant_activations)
        wcfg = WorkerConfig(coordinator=coordinator_addr, model=model, worker_id=worker_id, threads=threads,
                            core_share=core_share, **extra)
    except PdserveError as e:
        raise click.BadParameter(str(e)) from e
    return ecfg, wcfg

DEFAULT_PROMPT = "Tell me about Paris in two sentences."


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """pdserve: a disaggregated prefill/decode LLM inference engine."""


def _sampling_options(f):
    opts = [
        click.option("--max-tokens", default=128, show_default=True, type=int),
        click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy"),
        click.option("--top-p", default=1.0, type=float),
        click.option("--top-k", default=-1, type=int),
        click.option("--seed", default=None, type=int),
        click.option("--ignore-eos", is_flag=True),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@main.command()
@click.argument("prompt", required=False, default=DEFAULT_PROMPT)
@click.option("--coordinator", "address", default=COORDINATOR_CLIENTS, show_default=True, help="coordinator client port")
@click.option("--local", is_flag=True, help="load the model in this process instead of asking a running service")
@click.option("--model", default=None, help="with --local: GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--chat/--raw", default=True, show_default=True, help="apply the model's chat template")
@click.option("--timeout", default=120.0, show_default=True)
@click.option("--keys", default=None, type=click.Path(), help="CurveZMQ keys directory (pdserve keygen)")
@_sampling_options
def generate(prompt, address, local, model, dtype, chat, timeout, keys, **sampling):
    """Stream a completion for PROMPT to the terminal (from the running service, or --local)."""
    from pdserve_client.errors import PdserveError

    try:
        if local:
            _generate_local(prompt, model, dtype, chat, sampling)
        else:
            _generate_remote(prompt, address, chat, timeout, keys, sampling)
    except PdserveError as e:
        raise click.ClickException(f"{e.code}: {e}") from e


def _generate_remote(prompt, address, chat, timeout, keys, sampling):
    from pdserve_client.library import Client, ClientError

    kw = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    with Client(address, timeout=timeout, keys=keys) as client:
        try:
            for delta in client.stream(**kw, **sampling):
                click.echo(delta.text, nl=False)
                if delta.result is not None:
                    r = delta.result
                    click.echo("")
                    tps = r.completion_tokens / max(r.latency, 1e-9)
                    click.echo(f"[{r.completion_tokens} tokens, finish {r.finish_reason}, TTFT {r.client_ttft or 0:.3f}s, "
                               f"{tps:.1f} tok/s]", err=True)
        except ClientError as e:
            raise click.ClickException(f"{e} (is the service running? start it with scripts/serve)") from e


def _generate_local(prompt, model, dtype, chat, sampling):
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from pdserve_client.params import SamplingParams
    from runtime.tokenizer import render_chat

    params = SamplingParams(**sampling)
    params.validate()
    t0 = time.perf_counter()
    engine = LLMEngine.load(model, EngineConfig(dtype=dtype, kv_cache_bytes=64 * 2**20))
    click.echo(f"[loaded in {time.perf_counter() - t0:.2f}s]", err=True)
    ids = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}]) if chat else engine.encode(prompt)
    engine.add_request(ids, params, request_id="cli")
    t0 = time.perf_counter()
    n = 0
    while engine.has_work():
        for out in engine.step():
            n += out.token_id is not None
            click.echo(out.text, nl=False)
            sys.stdout.flush()
    dt = time.perf_counter() - t0
    click.echo("")
    click.echo(f"[{n} tokens in {dt:.2f}s, {n / dt:.1f} tok/s]", err=True)

_SECRET_OPTION = click.option("--worker-secret-file", default=None, type=click.Path(exists=True, dir_okay=False),
                              help="without --keys: the per-launch worker secret (a 0600 file; `pdserve launch` writes one)")


def _security_options(f):
    f = click.option("--insecure", is_flag=True, help="allow binding beyond loopback without CurveZMQ keys")(f)
    return click.option("--keys", default=None, type=click.Path(), help="CurveZMQ keys directory (pdserve keygen)")(f)


def _slo_options(f):
    opts = [
        click.option("--slo/--no-slo", default=True, show_default=True, help="predict latency, place by it, shed what cannot meet the targets"),
        click.option("--ttft-p99-ms", default=5000.0, show_default=True, help="p99 time-to-first-token target (priority class 0)"),
        click.option("--tpot-p99-ms", default=500.0, show_default=True, help="p99 time-per-output-token target (priority class 0)"),
        click.option("--class-target", multiple=True, help="PRIORITY:TTFT_MS:TPOT_MS targets of another priority class"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _topology_options(f):
    """Each request's path and the planner that moves roles with the load (coordinator/paths.py, planner.py)."""
    opts = [
        click.option("--paths", default="remote", show_default=True, type=click.Choice(["auto", "remote", "local"]),
                     help="remote: every request of a (prefill, decode) pair is prefilled on a prefill worker (the default until "
                          "auto holds the overload test's targets reliably: README, Paths and roles); auto: each request "
                          "prefilled on its decode worker (local) or on a prefill worker (remote): with SLO control the way "
                          "that meets its targets, local first where the two share a node's cores; without it local for "
                          "short prompts or a long prefill queue; local: always on the decode worker"),
        click.option("--local-prefill-tokens", default=512, show_default=True, type=click.IntRange(0),
                     help="without SLO control (--paths auto): prompts with at most this many uncached tokens are prefilled locally"),
        click.option("--planner/--no-planner", default=False, show_default=True,
                     help="with SLO control, move workers that can switch role (prefill <-> decode) to the phase short of capacity "
                          "(off by default until it holds the targets under overload: README, Paths and roles)"),
        click.option("--planner-window-s", default=2.0, show_default=True, type=click.FloatRange(0.1),
                     help="the planner's measurement window (a phase must be short 3 windows in a row before a role moves)"),
        click.option("--planner-dwell-s", default=20.0, show_default=True, type=click.FloatRange(0.0),
                     help="a worker keeps a role at least this long (no flapping)"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _planner(planner, planner_window_s, planner_dwell_s):
    from coordinator.planner import PlannerConfig

    return PlannerConfig(window_s=planner_window_s, min_dwell_s=planner_dwell_s) if planner else None


def _topology_args(paths, local_prefill_tokens, planner, planner_window_s, planner_dwell_s) -> list[str]:
    """The same options as flags, for the coordinator `pdserve launch` starts."""
    return ["--paths", paths, "--local-prefill-tokens", str(local_prefill_tokens), "--planner" if planner else "--no-planner",
            "--planner-window-s", str(planner_window_s), "--planner-dwell-s", str(planner_dwell_s)]


def _tracing_options(f):
    f = click.option("--otlp-traces-protocol", default="grpc", show_default=True, envvar="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                     type=click.Choice(["grpc", "http/protobuf"]), help="OTLP transport of --otlp-traces-endpoint")(f)
    return click.option("--otlp-traces-endpoint", default=None,
                        help="export a span per request (a child per phase) to this OTLP collector, e.g. http://127.0.0.1:4317")(f)


def _check_tracing(endpoint, protocol) -> None:
    """A usage error now, not a coordinator that dies at start, if the OpenTelemetry extra is missing."""
    if endpoint:
        from coordinator.tracing import TracingUnavailable, exporter_class

        try:
            exporter_class(protocol)
        except TracingUnavailable as e:
            raise click.UsageError(str(e)) from None


def _chat_template_option(f):
    return click.option("--chat-template", default=None,
                        help="a Jinja chat template (a file, or the template itself) used instead of the model's own, e.g. one "
                             "that shows tools")(f)


def _chat_template(value):
    from pdserve_client.errors import PdserveError
    from runtime.tokenizer import load_chat_template

    try:
        return None if value is None else load_chat_template(value)
    except PdserveError as e:
        raise click.BadParameter(str(e)) from None


def _tool_options(f):
    """Tool calling and reasoning output on the gateway (gateway/tools.py), vLLM's flags."""
    from gateway.reasoning import REASONING_PARSERS
    from gateway.tool_parsers import PARSERS

    opts = [
        click.option("--enable-auto-tool-choice", is_flag=True, help='serve tool_choice "auto" (needs --tool-call-parser)'),
        click.option("--tool-call-parser", default=None, type=click.Choice(sorted(PARSERS)),
                     help="how the model writes tool calls, for tool_choice auto"),
        click.option("--reasoning-parser", default=None, type=click.Choice(sorted(REASONING_PARSERS)),
                     help="split the model's <think> block into reasoning_content"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _tool_config(enable_auto_tool_choice, tool_call_parser, reasoning_parser):
    from gateway.tools import ToolConfig
    from pdserve_client.errors import PdserveError

    try:
        return ToolConfig(enable_auto_tool_choice, tool_call_parser, reasoning_parser)
    except PdserveError as e:
        raise click.UsageError(str(e)) from None


def _tool_args(enable_auto_tool_choice, tool_call_parser, reasoning_parser) -> list[str]:
    """The same options as flags, for the gateway `pdserve launch` starts."""
    return ((["--enable-auto-tool-choice"] if enable_auto_tool_choice else []) + (["--tool-call-parser", tool_call_parser] if tool_call_parser else [])
            + (["--reasoning-parser", reasoning_parser] if reasoning_parser else []))


def _limit_options(f):
    """What one request may carry (wire/limits.py); the coordinator and the gateway both check them."""
    opts = [
        click.option("--max-prompt-bytes", default=2**20, show_default=True, type=click.IntRange(1),
                     help="UTF-8 bytes of a prompt (or a chat's messages) before tokenizing; more is a 400"),
        click.option("--max-stop", default=64, show_default=True, type=click.IntRange(1), help="stop strings per request"),
        click.option("--max-stop-length", default=256, show_default=True, type=click.IntRange(1), help="characters of one stop string"),
        click.option("--max-client-priority", default=0, show_default=True, type=int,
                     help="the highest priority class a request may ask for (higher is a 400)"),
        click.option("--client-target-range", default="1:1", show_default=True,
                     help="LO:HI: a request's own ttft_ms/tpot_ms must lie within LO..HI times its class's targets"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _limits(max_prompt_bytes, max_stop, max_stop_length, max_client_priority, client_target_range):
    from pdserve_client.errors import PdserveError
    from wire.limits import RequestLimits

    try:
        lo, hi = (float(x) for x in client_target_range.split(":"))
        return RequestLimits(max_prompt_bytes, max_stop, max_stop_length, max_client_priority=max_client_priority,
                             client_target_range=(lo, hi))
    except (ValueError, PdserveError) as e:
        raise click.BadParameter(f"--client-target-range wants LO:HI with 0 < LO <= HI, got {client_target_range!r} ({e})") from None


def _limit_args(**limits) -> list[str]:
    """The same limits as flags, for the roles `pdserve launch` starts."""
    return [a for name, v in limits.items() for a in (f"--{name.replace('_', '-')}", str(v))]


def _class_targets(specs) -> dict:
    out = {}
    for spec in specs:
        try:
            prio, ttft, tpot = spec.split(":")
            out[int(prio)] = (float(ttft), float(tpot))
        except ValueError:
            raise click.BadParameter(f"--class-target wants PRIORITY:TTFT_MS:TPOT_MS, got {spec!r}") from None
    return out


@main.command()
@click.option("--clients", "client_addr", default=COORDINATOR_CLIENTS, show_default=True)
@click.option("--workers", "worker_addr", default=COORDINATOR_WORKERS, show_default=True)
@click.option("--model", default=None, help="the model whose tokenizer to load")
@click.option("--worker-timeout", default=2.0, show_default=True, help="seconds without a heartbeat before a worker is dropped")
@click.option("--pending-timeout", default=60.0, show_default=True, help="seconds a request may wait for KV room before it is shed")
@click.option("--admit-timeout", default=10.0, show_default=True,
              help="seconds a decode worker may leave an admission unanswered before the request is placed again")
@click.option("--max-active-requests", default=4096, show_default=True, help="requests in flight before new ones are refused (overloaded)")
@click.option("--max-client-requests", default=1024, show_default=True, help="the same, per client connection")
@click.option("--client-send-budget-kb", default=None, type=click.IntRange(64),
              help="KiB queued for one client that does not read, past which its requests are aborted (client_too_slow; default 32768)")
@_slo_options
@_topology_options
@_limit_options
@_security_options
@_tracing_options
@click.option("--served-model-name", default=None, help="the model's name in the traces (default: the file or directory name)")
@_SECRET_OPTION
@_chat_template_option
@click.option("-v", "--verbose", is_flag=True)
def coordinator(client_addr, worker_addr, model, worker_timeout, pending_timeout, admit_timeout, max_active_requests, max_client_requests,
                client_send_budget_kb, slo, ttft_p99_ms, tpot_p99_ms, class_target, paths, local_prefill_tokens, planner,
                planner_window_s, planner_dwell_s, keys, insecure, otlp_traces_endpoint, otlp_traces_protocol, served_model_name, worker_secret_file,
                chat_template, verbose, **limits):
    """Run the coordinator: places requests on workers and streams tokens to clients."""
    from coordinator.server import CoordinatorConfig, serve

    _logging(verbose)
    _check_tracing(otlp_traces_endpoint, otlp_traces_protocol)
    serve(CoordinatorConfig(client_addr, worker_addr, model, worker_timeout_s=worker_timeout, pending_timeout_s=pending_timeout,
                            admit_timeout_s=admit_timeout,
                            max_active_requests=max_active_requests, max_client_requests=max_client_requests,
                            slo=slo, ttft_ms=ttft_p99_ms, tpot_ms=tpot_p99_ms, paths=paths, local_prefill_tokens=local_prefill_tokens,
                            planner=_planner(planner, planner_window_s, planner_dwell_s),
                            class_targets=_class_targets(class_target), keys=keys, insecure=insecure,
                            otlp_traces_endpoint=otlp_traces_endpoint, otlp_traces_protocol=otlp_traces_protocol,
                            served_model_name=served_model_name, limits=_limits(**limits), worker_secret_file=worker_secret_file,
                            chat_template=_chat_template(chat_template),
                            **({"client_send_budget": client_send_budget_kb * 1024} if client_send_budget_kb else {})))


@main.command()
@click.option("--coordinator", "address", default=COORDINATOR_CLIENTS, show_default=True, help="coordinator client port")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--model", default=None, help="the served model, for its tokenizer and name (default: SmolLM2-135M-Instruct)")
@click.option("--served-model-name", default=None, help="the name clients ask for (default: the model's file or directory name)")
@click.option("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 requests")
@click.option("--request-timeout", default=600.0, show_default=True, help="seconds one request may take")
@click.option("--keys", default=None, type=click.Path(), help="CurveZMQ keys directory (pdserve keygen)")
@click.option("--max-inflight", default=1024, show_default=True, type=click.IntRange(1),
              help="coordinator requests in flight for all HTTP requests (keep <= the coordinator's --max-client-requests); "
                   "one HTTP request holds at most a fair share of them")
@click.option("--stream-buffer-kb", default=None, type=click.IntRange(16),
              help="KiB of events one HTTP request may leave unread, past which its streams are aborted (client_too_slow; default 4096)")
@_limit_options
@_tool_options
@_chat_template_option
@click.option("-v", "--verbose", is_flag=True)
def gateway(address, host, port, model, served_model_name, api_key, request_timeout, keys, max_inflight, stream_buffer_kb,
            enable_auto_tool_choice, tool_call_parser, reasoning_parser, chat_template, verbose, **limits):
    """Run the OpenAI-compatible HTTP gateway (/v1/completions, /v1/chat/completions, /metrics)."""
    from gateway.server import GatewayConfig, serve
    from pdserve_client.errors import PdserveError

    _logging(verbose)
    try:
        cfg = GatewayConfig(address, host, port, model, served_model_name, api_key, request_timeout_s=request_timeout, keys=keys,
                            max_inflight=max_inflight, limits=_limits(**limits),
                            tools=_tool_config(enable_auto_tool_choice, tool_call_parser, reasoning_parser),
                            chat_template=_chat_template(chat_template),
                            **({"stream_buffer_bytes": stream_buffer_kb * 1024} if stream_buffer_kb else {}))
    except PdserveError as e:
        raise click.BadParameter(str(e)) from e
    serve(cfg)


_KV_BACKEND = click.option("--kv-backend", default="auto", type=click.Choice(["auto", "shm", "tcp", "cuda_ipc", "nccl"]), show_default=True,
                           help="how to hand KV to decode workers (auto: from each decode pool's description)")
_BATCH_WINDOW = click.option("--batch-window-ms", default=2.0, show_default=True, help="wait this long to pack more prompts into a forward")
_KV_BIND = click.option("--kv-bind", default="tcp://127.0.0.1:*", show_default=True, help="where prefill workers deliver KV")


@main.command()
@_engine_options
@_BATCH_WINDOW
@_KV_BACKEND
def prefill(verbose, batch_window_ms, kv_backend, **kw):
    """Run a dedicated prefill worker (private KV pool, never changes role): prompt forward passes, first token, KV hand-off."""
    from prefill.worker import serve

    _logging(verbose)
    ecfg, wcfg = _configs(batch_window_ms=batch_window_ms, kv_backend=kv_backend, **kw)
    serve(ecfg, wcfg)


def _serve_worker(role: str, verbose, **kw) -> None:
    """Run the worker that can take every role, starting in `role`."""
    from wire.protocol import Role
    from decode.worker import serve

    _logging(verbose)
    ecfg, wcfg = _configs(**kw)
    serve(ecfg, wcfg, Role[role.upper()])


@main.command()
@_engine_options
@click.option("--role", default="decode", show_default=True, type=click.Choice(["prefill", "decode", "colocated"]),
              help="the role it starts in; the coordinator may change it (SetRole) without a restart")
@_KV_BIND
@_KV_BACKEND
@_BATCH_WINDOW
def worker(role, **kw):
    """Run a worker that can take any role: prefill (KV hand-off to decode workers), decode, or colocated."""
    _serve_worker(role, **kw)


@main.command()
@_engine_options
@_KV_BIND
@_KV_BACKEND
@_BATCH_WINDOW
@click.option("--colocated", is_flag=True, help="also prefill (the colocated baseline)")
def decode(colocated, **kw):
    """Run a decode worker (`pdserve worker --role decode`; --colocated: `--role colocated`)."""
    _serve_worker("colocated" if colocated else "decode", **kw)


@main.command()
@click.option("--coordinator", "address", default=COORDINATOR_CLIENTS, show_default=True)
@click.option("--timeout", default=10.0, show_default=True)
@click.option("--keys", default=None, type=click.Path(), help="CurveZMQ keys directory (pdserve keygen)")
def stats(address, timeout, keys):
    """Print the coordinator's stats as JSON."""
    from pdserve_client.library import Client, ClientError

    with Client(address, timeout=timeout, keys=keys) as c:
        try:
            click.echo(json.dumps(c.stats(timeout), indent=2))
        except ClientError as e:
            raise click.ClickException(str(e)) from e


@main.command()
@click.option("--prefill", "n_prefill", default=1, show_default=True, help="prefill workers on this node")
@click.option("--decode", "n_decode", default=1, show_default=True, help="decode workers on this node")
@click.option("--colocated", is_flag=True, help="one colocated worker (chunked prefill + decode) instead")
@click.option("--fixed-roles", is_flag=True,
              help="dedicated prefill workers (`pdserve prefill`) and decode workers that keep their role; by default every worker "
                   "is `pdserve worker`, which the coordinator may move to another role")
@click.option("--config", "config_path", default=None, type=click.Path(exists=True), help="cluster TOML")
@click.option("--node", default=None, help="this node's name in the cluster TOML")
@click.option("--model", default=None)
@click.option("--kv-backend", default="auto", type=click.Choice(["auto", "shm", "tcp", "cuda_ipc", "nccl"]))
@click.option("--clients", "client_addr", default=COORDINATOR_CLIENTS, show_default=True)
@click.option("--workers", "worker_addr", default=COORDINATOR_WORKERS, show_default=True)
@click.option("--threads", default=None, type=int, help="torch threads per worker (default: cores / workers)")
@click.option("--prefill-tp", default=None, type=click.IntRange(1), help="tensor parallel size of the prefill workers")
@click.option("--decode-tp", default=None, type=click.IntRange(1), help="tensor parallel size of the decode (or colocated) workers")
@click.option("--log-dir", default=None, help="write each process's log here instead of the terminal")
@click.option("--engine-arg", multiple=True, help="extra flag for every worker, e.g. --engine-arg=--kv-cache-mb=256")
@click.option("--gateway/--no-gateway", default=True, show_default=True, help="the OpenAI HTTP gateway, beside the coordinator")
@click.option("--http-host", default="127.0.0.1", show_default=True)
@click.option("--http-port", default=8000, show_default=True, type=int)
@click.option("--api-key", default=None, help="the gateway requires `Authorization: Bearer KEY`")
@click.option("--max-inflight", default=1024, show_default=True, type=click.IntRange(1),
              help="the gateway's coordinator requests in flight, shared fairly between HTTP requests")
@click.option("--hang-timeout-s", default=HANG_TIMEOUT_S, show_default=True, type=click.FloatRange(2.0),
              help="a role whose main loop has not run for this long is killed and restarted (keep it above the longest "
                   "engine step: raise it for a big model on the CPU or a larger --max-num-batched-tokens)")
@_slo_options
@_topology_options
@_limit_options
@_security_options
@_tracing_options
@_tool_options
@_chat_template_option
@engine_flag_options
def launch(n_prefill, n_decode, colocated, fixed_roles, config_path, node, model, kv_backend, client_addr, worker_addr, threads, prefill_tp, decode_tp, log_dir,
           engine_arg, gateway, http_host, http_port, api_key, max_inflight, hang_timeout_s, slo, ttft_p99_ms, tpot_p99_ms, class_target,
           paths, local_prefill_tokens, planner, planner_window_s, planner_dwell_s, keys, insecure,
           otlp_traces_endpoint, otlp_traces_protocol, served_model_name,
           max_prompt_bytes, max_stop, max_stop_length, max_client_priority, client_target_range,
           enable_auto_tool_choice, tool_call_parser, reasoning_parser, chat_template, **engine_flags):
    """Start every role of this node (default: coordinator + 1 prefill + 1 decode) and wait."""
    from pdserve.launch import Launcher, NodePlan, plan_from_toml
    from pdserve_client.errors import PdserveError

    try:
        if config_path:
            if not node:
                raise click.BadParameter("--config needs --node NAME")
            plan = plan_from_toml(config_path, node)
        else:
            counts = dict(prefill=0, decode=0, colocated=1) if colocated else dict(prefill=n_prefill, decode=n_decode)
            plan = NodePlan(**counts, model=model, kv_backend=kv_backend, threads=threads, client_addr=client_addr, worker_addr=worker_addr)
    except PdserveError as e:
        raise click.ClickException(str(e)) from e
    plan.engine_args += worker_args(engine_flags) + [a for arg in engine_arg for a in arg.split("=", 1)]
    plan.prefill_args += ["--tensor-parallel-size", str(prefill_tp)] if prefill_tp else []
    plan.decode_args += ["--tensor-parallel-size", str(decode_tp)] if decode_tp else []
    plan.served_model_name = served_model_name or plan.served_model_name
    plan.coordinator_args += ["--slo" if slo else "--no-slo", "--ttft-p99-ms", str(ttft_p99_ms), "--tpot-p99-ms", str(tpot_p99_ms)]
    plan.coordinator_args += [a for spec in class_target for a in ("--class-target", spec)]
    plan.coordinator_args += _topology_args(paths, local_prefill_tokens, planner and not (fixed_roles or plan.fixed_roles),
                                            planner_window_s, planner_dwell_s)  # fixed roles: nothing to plan
    _check_tracing(otlp_traces_endpoint, otlp_traces_protocol)
    if otlp_traces_endpoint:
        plan.coordinator_args += ["--otlp-traces-endpoint", otlp_traces_endpoint, "--otlp-traces-protocol", otlp_traces_protocol]
        plan.coordinator_args += ["--served-model-name", plan.served_model_name] if plan.served_model_name else []
    limits = dict(max_prompt_bytes=max_prompt_bytes, max_stop=max_stop, max_stop_length=max_stop_length,
                  max_client_priority=max_client_priority, client_target_range=client_target_range)
    _limits(**limits)  # a bad value is a usage error before anything starts
    plan.coordinator_args += _limit_args(**limits)
    plan.gateway_args += _limit_args(**limits) + ["--max-inflight", str(max_inflight)]
    _tool_config(enable_auto_tool_choice, tool_call_parser, reasoning_parser)  # a bad combination is a usage error now
    plan.gateway_args += _tool_args(enable_auto_tool_choice, tool_call_parser, reasoning_parser)
    if chat_template is not None:
        _chat_template(chat_template)  # a file that cannot be read is a usage error before anything starts
        plan.coordinator_args += ["--chat-template", chat_template]
        plan.gateway_args += ["--chat-template", chat_template]
    plan.keys = keys or plan.keys
    plan.insecure = insecure or plan.insecure
    plan.gateway, plan.http_host, plan.http_port, plan.api_key = gateway and plan.coordinator, http_host, http_port, api_key
    plan.hang_timeout_s = hang_timeout_s
    plan.fixed_roles = fixed_roles or plan.fixed_roles

    def ready(stats):
        workers = ", ".join(f"{w['id']} ({w['role']}, {w['total_blocks']} blocks)" for w in (stats or {}).get("workers", []))
        click.echo(f"pdserve ready: clients -> {plan.client_addr}; workers: {workers}", err=True)
        if plan.gateway:
            click.echo(f"OpenAI API -> {plan.http_url}/v1 (metrics at {plan.http_url}/metrics)", err=True)
        click.echo("stop with Ctrl-C", err=True)

    sys.exit(Launcher(plan, log_dir, _usage_error).run_forever(ready))


def _usage_error(role: str, args: list[str]) -> str | None:
    """click's message if `pdserve ROLE ARGS` would not parse, else None (the command is not run):
    the launcher checks each role's flags before it starts any."""
    try:
        main.commands[role].make_context(f"pdserve {role}", list(args))
    except click.ClickException as e:
        return e.format_message()
    return None


@main.command(context_settings={"ignore_unknown_options": True}, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args):
    """Benchmark serving latency and throughput, like `vllm bench serve` (see `pdserve bench --help`)."""
    from pdserve.bench import main as bench_main

    sys.exit(bench_main(list(args)))


@main.command()
@click.argument("directory", type=click.Path())
def keygen(directory):
    """Write CurveZMQ keys for a cluster into DIRECTORY (copy it to every node; pass --keys DIRECTORY)."""
    from wire.security import keygen as make_keys

    d = make_keys(directory)
    click.echo(f"wrote server and client keypairs to {d} (authorized client keys in {d / 'authorized'})")
