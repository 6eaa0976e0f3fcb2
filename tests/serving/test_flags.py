"""Each flag is defined once, on the config dataclass field it sets (common/flags.py): every
command that takes it gets one option built from that declaration, with the field's default and
its help; `--help` lists the options in sections by concern; what `pdserve launch` passes on to a
role parses there to the same values; and building the CLI imports no torch."""
import dataclasses
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from pdserve.cli import COORDINATOR_LAUNCH, ENGINE, GATEWAY, GATEWAY_LAUNCH, GATEWAY_PASSED, main
from pdserve.common.flags import FIELD_DEFAULT, GROUPS
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.planner import PlannerConfig
from pdserve.flags import GroupedOption, as_args, field_values, specs, worker_args
from pdserve.gateway.config import GatewayConfig, ToolConfig
from pdserve.launch import NodePlan
from pdserve.ray_config import RayConfig
from pdserve.runtime.config import EngineConfig, WorkerConfig
from pdserve.wire.limits import RequestLimits

CLASSES = (EngineConfig, WorkerConfig, CoordinatorConfig, PlannerConfig, RequestLimits, GatewayConfig, ToolConfig, RayConfig)
# command -> the config classes whose flags it takes (all of them, or only those marked launch)
TAKES = {
    "worker": [(EngineConfig, False), (WorkerConfig, False)],
    "prefill": [(EngineConfig, False)],
    "decode": [(EngineConfig, False), (WorkerConfig, False)],
    "coordinator": [(CoordinatorConfig, False), (PlannerConfig, False), (RequestLimits, False)],
    "gateway": [(GatewayConfig, False), (ToolConfig, False), (RequestLimits, False)],
    "launch": [(EngineConfig, True), (CoordinatorConfig, True), (PlannerConfig, True), (RequestLimits, True), (GatewayConfig, True),
               (ToolConfig, True), (RayConfig, False)],
}
COMMAND_OF = {EngineConfig: "worker", WorkerConfig: "worker", GatewayConfig: "gateway", ToolConfig: "gateway", RayConfig: "launch"}  # else: coordinator


def params_named(command: click.Command, name: str) -> list[click.Parameter]:
    return [p for p in command.params if p.name == name]


@pytest.mark.parametrize("command", sorted(TAKES))
def test_every_flag_appears_once_with_its_declared_default_and_help(command):
    cmd = main.commands[command]
    spellings = [o for p in cmd.params for o in p.opts + p.secondary_opts]
    assert len(spellings) == len(set(spellings)), sorted(o for o in spellings if spellings.count(o) > 1)
    for cls, launch_only in TAKES[command]:
        for spec in specs(cls, launch_only):
            found = params_named(cmd, spec.name)
            assert len(found) == 1, (command, spec.name)
            opt = found[0]
            engine_on_launch = command == "launch" and cls is EngineConfig  # None: not given, the worker's default stands
            shown = f"  [default: {spec.default}]" if engine_on_launch and spec.default not in (None, False) else ""
            assert isinstance(opt, GroupedOption) and opt.group == spec.flag.group and opt.help == spec.flag.help + shown
            assert spec.spelling in opt.opts and set(spec.flag.aliases) <= set(opt.opts)
            assert opt.default == (None if engine_on_launch else spec.default), (command, spec.name)


@pytest.mark.parametrize("cls", CLASSES)
def test_command_defaults_are_the_fields_defaults(cls):
    """Where a field's value is typed as it is, the option's default is the field's default."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    command = COMMAND_OF.get(cls, "coordinator")
    checked = 0
    for spec in specs(cls):
        fl, field = spec.flag, fields[spec.field]
        if fl.command_default is FIELD_DEFAULT and spec.kind in ("int", "float", "str") and fl.scale == 1 and not fl.multiple:
            [opt] = params_named(main.commands[command], spec.name)
            assert opt.default == field.default, spec.name
            checked += 1
    assert checked >= 2


def test_the_defaults_that_are_not_the_fields():
    """The worker commands' own defaults, declared beside the field; MiB / KiB flags of byte fields; switches."""
    worker, coordinator = main.commands["worker"], main.commands["coordinator"]
    default = {p.name: p.default for p in worker.params + coordinator.params}
    assert default["linear_backend"] == "auto" and EngineConfig().linear_backend == "rules"
    assert default["kv_cache_mb"] is None  # sized at start from the machine (auto_kv_cache_mb)
    assert default["client_send_budget_kb"] * 1024 == CoordinatorConfig().client_send_budget
    assert default["no_prefix_cache"] is False and EngineConfig().prefix_cache is True
    assert default["planner"] is True and CoordinatorConfig().planner is None  # on in the commands, off in-process
    assert default["client_target_range"] == "1:1" and RequestLimits().client_target_range == (1.0, 1.0)
    assert default["max_num_batched_tokens"] == 2048 and default["quant_activations"] == "int16"


@pytest.mark.parametrize("command", ["worker", "coordinator", "launch", "gateway"])
def test_help_is_in_sections_by_concern(command):
    out = CliRunner().invoke(main, [command, "--help"], terminal_width=200).output
    titles = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    want = [g[0].upper() + g[1:] for g in GROUPS]
    shown = [t for t in titles if t in want]
    assert shown == sorted(shown, key=want.index) and len(shown) >= 2, titles
    assert titles[titles.index("Options") + 1:] == shown  # the command's own options first, then the groups
    if command == "launch":
        section = out.split("KV cache and transfer:")[1].split("\n\n")[0]
        assert "--block-size" in section and "[default: 16]" in section and "--kv-backend" in section
        assert "Request limits:" in out and "--max-stop-length" in out.split("Request limits:")[1]


def test_what_launch_passes_on_parses_to_the_same_values():
    """The engine flags and the coordinator's, given to `pdserve launch`, reach the role as typed."""
    given = {"dtype": "float32", "kv_cache_mb": 128, "max_num_batched_tokens": 512, "no_prefix_cache": True, "quantization": "none",
             "tensor_parallel_size": 2, "linear_backend": "c"}
    args = worker_args(given)
    assert args[:2] == ["--dtype", "float32"] and "--no-prefix-cache" in args
    parsed = main.commands["worker"].make_context("worker", args).params
    assert {k: parsed[k] for k in given} == given
    with pytest.raises(click.BadParameter, match="block_size must be a power of two"):
        worker_args({"block_size": 12})
    values = {s.name: s.default for s in COORDINATOR_LAUNCH}
    values.update(slo=False, ttft_p99_ms=300.0, class_target=("1:900:90", "2:2000:200"), paths="auto", planner=True, planner_dwell_s=5.0)
    parsed = main.commands["coordinator"].make_context("coordinator", as_args(COORDINATOR_LAUNCH, values)).params
    assert {k: parsed[k] for k in values} == values


def test_the_gateway_command_with_no_flags_builds_the_default_config():
    """Every flag of `pdserve gateway` left out gives GatewayConfig's own value (--stream-buffer-kb: KiB of a byte field)."""
    parsed = main.commands["gateway"].make_context("gateway", []).params
    assert GatewayConfig(**field_values(GATEWAY, parsed)) == GatewayConfig()
    assert parsed["stream_buffer_kb"] * 1024 == GatewayConfig().stream_buffer_bytes and parsed["max_inflight"] == 1024
    parsed = main.commands["gateway"].make_context("gateway", ["--stream-buffer-kb", "16", "--request-timeout", "5"]).params
    assert GatewayConfig(**field_values(GATEWAY, parsed)) == GatewayConfig(stream_buffer_bytes=16 * 1024, request_timeout_s=5.0)


def test_what_launch_passes_to_the_gateway_parses_to_the_same_values():
    """launch's gateway flags: --http-host / --http-port are the gateway's --host / --port (through NodePlan),
    the rest reach `pdserve gateway` as typed."""
    launch = {p.name: p for p in main.commands["launch"].params}
    gateway = {p.name: p for p in main.commands["gateway"].params}
    assert launch["http_host"].default == gateway["host"].default == NodePlan.http_host == GatewayConfig.host
    assert launch["http_port"].default == gateway["port"].default == NodePlan.http_port == GatewayConfig.port
    assert {s.name for s in GATEWAY_LAUNCH} - {s.name for s in GATEWAY_PASSED} == {"http_host", "http_port", "api_key", "served_model_name"}
    values = {"max_inflight": 8, "enable_auto_tool_choice": True, "tool_call_parser": "hermes", "reasoning_parser": "qwen3"}
    parsed = main.commands["gateway"].make_context("gateway", as_args(GATEWAY_PASSED, values)).params
    assert {k: parsed[k] for k in values} == values


def test_engine_flags_of_launch_are_the_engines():
    assert {s.name for s in ENGINE if s.flag.launch} == {
        "dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_mb", "gpu_memory_utilization",
        "block_size", "quantization", "quant_activations", "tensor_parallel_size", "pipeline_parallel_size", "linear_backend",
        "no_prefix_cache", "kv_cache_dtype", "kv_host_tier_mb"}


def test_building_the_command_line_imports_no_torch():
    """Nor starlette: the gateway's flags come from gateway/config.py, not its server; nor ray (only `launch --ray` loads it)."""
    code = ("import sys; from click.testing import CliRunner; from pdserve.cli import main\n"
            "helps = [CliRunner().invoke(main, [c, '--help']).output for c in ('launch', 'worker', 'coordinator', 'gateway')]\n"
            "print(all('--block-size' in h or '--ttft-p99-ms' in h or '--max-inflight' in h for h in helps), 'torch' in sys.modules,"
            " 'starlette' in sys.modules, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False", "False"]
