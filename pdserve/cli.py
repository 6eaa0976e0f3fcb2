"""The `pdserve` command line. The roles' flags are built from the config dataclasses that declare
them (EngineConfig, WorkerConfig, CoordinatorConfig, PlannerConfig, RequestLimits, GatewayConfig,
ToolConfig, RayConfig: pdserve/flags.py),
each command's `--help` in sections by concern. Each sub-command imports its role lazily, so
`pdserve --help` stays fast and the coordinator's commands never import the model code."""
from __future__ import annotations

import json
import logging
import os
import sys
import time

import click

from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.planner import PlannerConfig
from pdserve.flags import ENGINE_LAUNCH, GroupedCommand, GroupedOption, as_args, field_values, options, specs, worker_args
from pdserve.gateway.config import API_KEY_ENV, GatewayConfig, ModelRoute, ToolConfig
from pdserve.launch import HANG_TIMEOUT_S, ConfigError, NodePlan
from pdserve.ray_config import RayConfig
from pdserve.runtime.config import EngineConfig, WorkerConfig
from pdserve.wire.limits import RequestLimits
from pdserve_client.errors import PdserveError

COORDINATOR_CLIENTS = CoordinatorConfig.client_addr
ENGINE = specs(EngineConfig)
WORKER = specs(WorkerConfig)
COORDINATOR = specs(CoordinatorConfig)
PLANNER = specs(PlannerConfig)
LIMITS = specs(RequestLimits)
KEYS = [s for s in WORKER if s.name == "keys"]  # the clients' --keys: the roles' own
[MODEL] = [s for s in WORKER if s.name == "model"]  # `pdserve launch` takes it repeated, as PATH[=NAME]
CHAT_TEMPLATE = [s for s in COORDINATOR if s.name == "chat_template"]
TRACING = [s for s in COORDINATOR if s.flag.group == "tracing" and s.flag.launch]
# what `pdserve launch` passes to the coordinator as they are (tracing, limits and the chat template: below)
COORDINATOR_LAUNCH = [s for s in COORDINATOR + PLANNER if s.flag.launch and s.flag.group in ("SLO", "paths and roles")]
RAY = specs(RayConfig)  # `pdserve launch --ray`: its own flags (pdserve/ray_config.py)
GATEWAY = specs(GatewayConfig)
TOOLS = specs(ToolConfig)
GATEWAY_LAUNCH = specs(GatewayConfig, launch_only=True) + specs(ToolConfig, launch_only=True)
# what `pdserve launch` passes to the gateway as they are (its HTTP address, key and model name go through NodePlan)
GATEWAY_PASSED = [s for s in GATEWAY_LAUNCH if s.field not in ("host", "port", "api_key", "served_model_name")]


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _engine_options(f):
    """The worker commands' flags: EngineConfig's and WorkerConfig's (--kv-bind, --kv-backend and
    --batch-window-ms: each command adds those its role uses)."""
    f = options(ENGINE + [s for s in WORKER if s.name not in ("kv_bind", "kv_backend", "batch_window_ms")])(f)
    f = click.option("-v", "--verbose", is_flag=True)(f)
    return click.option("--int8-activations", is_flag=True, cls=GroupedOption, group="model and weights",
                        help="the same as --quant-activations int8")(f)


def _configs(kv_cache_mb, int8_activations, **values):
    """A worker command's EngineConfig and WorkerConfig from its flags; a bad value is a usage error."""
    from pdserve.kvtransfer.pool_files import sweep_dead_pools
    from pdserve.runtime.config import auto_kv_cache_mb

    engine, worker = field_values(ENGINE, values), field_values(WORKER, values)
    if kv_cache_mb is None:  # not used when --num-blocks or --gpu-memory-utilization sizes the pool
        sweep_dead_pools()  # pools of workers that are gone would shrink the budget (a SIGKILLed node leaves them)
        kv_cache_mb = auto_kv_cache_mb() if values["num_blocks"] is None and values["gpu_memory_utilization"] is None else 0
    engine["kv_cache_bytes"] = kv_cache_mb * 2**20
    if int8_activations:
        engine["quant_activations"] = "int8"
    try:
        return EngineConfig(**engine), WorkerConfig(**worker)
    except PdserveError as e:
        raise click.BadParameter(str(e)) from e


DEFAULT_PROMPT = "Tell me about Paris in two sentences."


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """pdserve: a disaggregated prefill/decode LLM inference engine."""


main.command_class = GroupedCommand  # every command's --help in sections by concern


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
@options(KEYS)
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
    from pdserve.common.tokenizer import render_chat
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine
    from pdserve_client.params import SamplingParams

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

def _planner(planner, planner_window_s, planner_dwell_s):
    return PlannerConfig(window_s=planner_window_s, min_dwell_s=planner_dwell_s) if planner else None


def _check_tracing(endpoint, protocol) -> None:
    """A usage error now, not a coordinator that dies at start, if the OpenTelemetry extra is missing."""
    if endpoint:
        from pdserve.coordinator.tracing import TracingUnavailable, exporter_class

        try:
            exporter_class(protocol)
        except TracingUnavailable as e:
            raise click.UsageError(str(e)) from None


def _chat_template(value):
    from pdserve.common.tokenizer import load_chat_template
    from pdserve_client.errors import PdserveError

    try:
        return None if value is None else load_chat_template(value)
    except PdserveError as e:
        raise click.BadParameter(str(e)) from None


def _tool_config(values: dict) -> ToolConfig:
    """Tool calling and reasoning output from their flags (gateway/config.py); --enable-auto-tool-choice
    without --tool-call-parser is a usage error."""
    try:
        return ToolConfig(**field_values(TOOLS, values))
    except PdserveError as e:
        raise click.UsageError(str(e)) from None


def _limits(values: dict) -> RequestLimits:
    """The request limits from their flags (wire/limits.py); a bad value is a usage error."""
    text = values["client_target_range"]
    try:
        lo, hi = (float(x) for x in text.split(":"))
        return RequestLimits(**field_values(LIMITS, values), client_target_range=(lo, hi))
    except (ValueError, PdserveError) as e:
        raise click.BadParameter(f"--client-target-range wants LO:HI with 0 < LO <= HI, got {text!r} ({e})") from None


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
@options(COORDINATOR + PLANNER + LIMITS)
@click.option("-v", "--verbose", is_flag=True)
def coordinator(verbose, **values):
    """Run the coordinator: places requests on workers and streams tokens to clients."""
    from pdserve.coordinator.server import serve

    _logging(verbose)
    _check_tracing(values["otlp_traces_endpoint"], values["otlp_traces_protocol"])
    serve(CoordinatorConfig(**{**field_values(COORDINATOR, values), "class_targets": _class_targets(values["class_target"]),
                               "planner": _planner(values["planner"], values["planner_window_s"], values["planner_dwell_s"]),
                               "limits": _limits(values), "chat_template": _chat_template(values["chat_template"]),
                               "expected_workers": tuple(values["expect_worker"])}))


def _api_key(values) -> str | None:
    """--api-key, else $PDSERVE_API_KEY (which `ps` does not show; `pdserve launch` hands it to its
    gateway that way), else none."""
    return values["api_key"] or os.environ.get(API_KEY_ENV) or None


@main.command()
@options(GATEWAY + TOOLS + LIMITS + CHAT_TEMPLATE)
@click.option("-v", "--verbose", is_flag=True)
def gateway(verbose, **values):
    """Run the OpenAI-compatible HTTP gateway (/v1/completions, /v1/chat/completions, /metrics)."""
    from pdserve.gateway.server import serve

    _logging(verbose)
    limits, tools, chat_template = _limits(values), _tool_config(values), _chat_template(values["chat_template"])
    try:
        cfg = GatewayConfig(**{**field_values(GATEWAY, values), "api_key": _api_key(values)}, limits=limits, tools=tools,
                            chat_template=chat_template,
                            more_models=tuple(map(ModelRoute.parse, values["more_model"])))
    except PdserveError as e:
        raise click.BadParameter(str(e)) from e
    serve(cfg)


_KV_BIND, _KV_BACKEND, _BATCH_WINDOW = (options([s for s in WORKER if s.name == name]) for name in ("kv_bind", "kv_backend", "batch_window_ms"))


@main.command()
@_engine_options
@_BATCH_WINDOW
@_KV_BACKEND
def prefill(verbose, **kw):
    """Run a dedicated prefill worker (private KV pool, never changes role): prompt forward passes, first token, KV hand-off."""
    from pdserve.prefill.fixed_worker import serve

    _logging(verbose)
    ecfg, wcfg = _configs(**kw)
    serve(ecfg, wcfg)


def _serve_worker(role: str, verbose, **kw) -> None:
    """Run the worker that can take every role, starting in `role`."""
    from pdserve.wire.protocol import Role
    from pdserve.worker.any_role import serve

    _logging(verbose)
    ecfg, wcfg = _configs(**kw)
    serve(ecfg, wcfg, Role[role.upper()])


@main.command()
@_engine_options
@click.option("--role", default="decode", show_default=True, type=click.Choice(["prefill", "decode", "colocated"]), cls=GroupedOption,
              group="paths and roles",
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
@click.option("--colocated", is_flag=True, cls=GroupedOption, group="paths and roles", help="also prefill (the colocated baseline)")
def decode(colocated, **kw):
    """Run a decode worker (`pdserve worker --role decode`; --colocated: `--role colocated`)."""
    _serve_worker("colocated" if colocated else "decode", **kw)


@main.command()
@click.option("--coordinator", "address", default=COORDINATOR_CLIENTS, show_default=True)
@click.option("--timeout", default=10.0, show_default=True)
@options(KEYS)
def stats(address, timeout, keys):
    """Print the coordinator's stats as JSON."""
    from pdserve_client.library import Client, ClientError

    with Client(address, timeout=timeout, keys=keys) as c:
        try:
            click.echo(json.dumps(c.stats(timeout), indent=2))
        except ClientError as e:
            raise click.ClickException(str(e)) from e


@main.command()
@click.option("--prefill", "n_prefill", default=NodePlan.prefill, show_default=True, help="prefill workers on this node")
@click.option("--decode", "n_decode", default=NodePlan.decode, show_default=True, help="decode workers on this node")
@click.option("--colocated", is_flag=True, help="one colocated worker (chunked prefill + decode) instead")
@click.option("--fixed-roles", is_flag=True,
              help="dedicated prefill workers (`pdserve prefill`) and decode workers that keep their role; by default every worker "
                   "is `pdserve worker`, which the coordinator may move to another role")
@click.option("--config", "config_path", default=None, type=click.Path(exists=True), help="cluster TOML")
@click.option("--node", default=None, help="this node's name in the cluster TOML")
@click.option("--threads", default=None, type=int, help="torch threads per worker (default: cores / workers)")
@click.option("--prefill-tp", default=None, type=click.IntRange(1), help="tensor parallel size of the prefill workers")
@click.option("--decode-tp", default=None, type=click.IntRange(1), help="tensor parallel size of the decode (or colocated) workers")
@click.option("--base-gpu-id", default=0, show_default=True, type=click.IntRange(0),
              help="with --device cuda each worker takes GPUs of its own (one per tensor-parallel rank), prefill workers first, "
                   "then decode and colocated ones, from this GPU on (SGLang's flag; CUDA_VISIBLE_DEVICES chooses the GPUs seen; "
                   "too few stops the launch before anything starts; --device cuda:K places every worker on cuda:K by hand)")
@click.option("--log-dir", default=None, help="write each process's log here instead of the terminal")
@click.option("--engine-arg", multiple=True, help="extra flag for every worker, e.g. --engine-arg=--kv-cache-mb=256")
@click.option("--gateway/--no-gateway", default=True, show_default=True, cls=GroupedOption, group="HTTP gateway",
              help="the OpenAI HTTP gateway, beside the coordinator")
@click.option("--hang-timeout-s", default=HANG_TIMEOUT_S, show_default=True, type=click.FloatRange(2.0),
              help="a role whose main loop has not run for this long is killed and restarted (keep it above the longest "
                   "engine step: raise it for a big model on the CPU or a larger --max-num-batched-tokens)")
@click.option("--model", "models", multiple=True, metavar="PATH[=NAME]", cls=GroupedOption, group=MODEL.flag.group,
              help=f"{MODEL.flag.help}; =NAME: the name clients send as `model` (as --served-model-name). Repeat it to serve several "
                   "models behind one gateway, each with its own coordinator (model i on the --clients and --workers ports + 2i) and "
                   "the same workers as the first")
@options([s for s in WORKER + COORDINATOR + PLANNER + LIMITS if s.flag.launch and s is not MODEL] + GATEWAY_LAUNCH)
@options(ENGINE_LAUNCH, unset=True)
@options(RAY)
def launch(n_prefill, n_decode, colocated, fixed_roles, config_path, node, threads, prefill_tp, decode_tp, base_gpu_id, log_dir, engine_arg,
           gateway, hang_timeout_s, models, **values):
    """Start every role of this node (default: coordinator + 1 prefill + 1 decode) and wait (--ray: the workers
    as actors of a Ray cluster, their counts following the traffic)."""
    from pdserve.launch import plan_from_toml

    (model, name), *more = [_model_and_name(m) for m in models] or [(None, None)]
    if name and values["served_model_name"]:
        raise click.BadParameter("name the first model once: --model PATH=NAME or --served-model-name NAME")
    try:
        if config_path:
            if not node:
                raise click.BadParameter("--config needs --node NAME")
            if more:
                raise click.BadParameter("several models with --config are not supported: launch each model's cluster on its own")
            plan = plan_from_toml(config_path, node)
        else:
            counts = dict(prefill=0, decode=0, colocated=1) if colocated else dict(prefill=n_prefill, decode=n_decode)
            plan = NodePlan(**counts, model=model, kv_backend=values["kv_backend"], threads=threads, client_addr=values["clients"],
                            worker_addr=values["workers"], served_model_name=name, more_models=more)
    except PdserveError as e:
        raise click.ClickException(str(e)) from e
    plan.engine_args += worker_args(values) + [a for arg in engine_arg for a in arg.split("=", 1)]
    plan.prefill_args += ["--tensor-parallel-size", str(prefill_tp)] if prefill_tp else []
    plan.decode_args += ["--tensor-parallel-size", str(decode_tp)] if decode_tp else []
    plan.base_gpu_id = base_gpu_id or plan.base_gpu_id
    plan.served_model_name = values["served_model_name"] or plan.served_model_name
    plan.fixed_roles = fixed_roles or plan.fixed_roles
    _coordinator_and_gateway_args(plan, values)
    plan.keys = values["keys"] or plan.keys
    plan.insecure = values["insecure"] or plan.insecure
    plan.gateway, plan.api_key = gateway and plan.coordinator, _api_key(values)
    plan.http_host, plan.http_port = values["http_host"], values["http_port"]
    plan.hang_timeout_s = hang_timeout_s

    launcher = _launcher(plan, log_dir, values)

    def ready(stats):
        workers = ", ".join(f"{w['id']} ({w['role']}, {w['total_blocks']} blocks)" for w in (stats or {}).get("workers", []))
        click.echo(f"pdserve ready: clients -> {plan.client_addr}; workers: {workers}", err=True)
        for m, name in zip(plan.models[1:], launcher.served_names()[1:] if plan.more_models else []):
            click.echo(f"model {name}: clients -> {m.client_addr}; workers: {', '.join(sorted(launcher.worker_ids(m)))}", err=True)
        if plan.gateway:
            click.echo(f"OpenAI API -> {plan.http_url}/v1 (metrics at {plan.http_url}/metrics)", err=True)
        click.echo("stop with Ctrl-C", err=True)

    sys.exit(launcher.run_forever(ready))


def _model_and_name(spec: str) -> tuple[str, str | None]:
    """--model PATH[=NAME] as (PATH, NAME or None); a path that exists is a path, '=' and all."""
    path, sep, name = spec.rpartition("=")
    return (spec, None) if not sep or os.path.exists(spec) else (path, name or None)


def _launcher(plan: NodePlan, log_dir, values: dict):
    """The node's Launcher, or with --ray the Ray launch (pdserve/ray_launch.py: ray is imported only then)."""
    from pdserve.launch import Launcher

    cfg = RayConfig(**field_values(RAY, values), min_replicas=values["min_replicas"], max_replicas=values["max_replicas"])
    if cfg.address is None:
        if cfg.min_replicas or cfg.max_replicas:
            raise click.UsageError("--min-replicas and --max-replicas need --ray (without it the counts are fixed)")
        return Launcher(plan, log_dir, _usage_error)
    try:
        from pdserve.ray_launch import RayLaunch
    except ImportError as e:
        raise click.UsageError(f"--ray needs Ray: pip install 'pdserve[ray]' ({e})") from None
    try:
        return RayLaunch(plan, cfg, log_dir, _usage_error)
    except (PdserveError, ConfigError) as e:  # ConfigError: the models' ports collide
        raise click.UsageError(str(e)) from None


def _coordinator_and_gateway_args(plan: NodePlan, values: dict) -> None:
    """The coordinator's and the gateway's flags `pdserve launch` was given, checked now (a bad value is a
    usage error before anything starts) and added to their command lines."""
    planner = values["planner"] and not plan.fixed_roles  # fixed roles: nothing to plan
    plan.coordinator_args += as_args(COORDINATOR_LAUNCH, {**values, "planner": planner})
    _check_tracing(values["otlp_traces_endpoint"], values["otlp_traces_protocol"])
    if values["otlp_traces_endpoint"]:
        plan.coordinator_args += as_args(TRACING, values)
    _limits(values)
    plan.coordinator_args += as_args(LIMITS, values)
    plan.gateway_args += as_args(LIMITS, values)
    _tool_config(values)
    plan.gateway_args += as_args(GATEWAY_PASSED, values)
    if values["chat_template"] is not None:
        _chat_template(values["chat_template"])
        plan.coordinator_args += as_args(CHAT_TEMPLATE, values)
        plan.gateway_args += as_args(CHAT_TEMPLATE, values)


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
    from pdserve.bench.command import main as bench_main

    sys.exit(bench_main(list(args)))


@main.command()
@click.argument("directory", type=click.Path())
def keygen(directory):
    """Write CurveZMQ keys for a cluster into DIRECTORY (copy it to every node; pass --keys DIRECTORY)."""
    from pdserve.wire.security import keygen as make_keys

    d = make_keys(directory)
    click.echo(f"wrote server and client keypairs to {d} (authorized client keys in {d / 'authorized'})")
