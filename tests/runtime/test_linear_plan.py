"""`--linear-backend` on a tiny random model (runtime.linear_plan): `auto` installs a measured
table on every linear layer and the model still computes what the rules compute (to float32
summation order); a fixed back-end runs everywhere it can; the teacher-forced gate passes an exact
back-end and refuses one that rounds too much, and `auto-reduced` then leaves the refused
precision out of the table; the figures are cached."""
import pytest
import torch

from pdserve.kernels import backends, cpu_native
from pdserve.runtime import linear_plan
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import load_model
from tests.helpers import save_tiny_model

pytestmark = pytest.mark.skipif(cpu_native.native() is None, reason="needs a C compiler for the fast path")

SEQS = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 23, 40)]
CONFIG = dict(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    save_tiny_model(d, hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=320)
    return d


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))


def logits(model) -> torch.Tensor:
    return torch.cat([linear_plan.prompt_logits(model, s, 1 << 30) for s in SEQS])


def test_auto_installs_a_measured_table_and_computes_what_the_rules_do(tiny_dir):
    _, rules = load_model(tiny_dir, EngineConfig(**CONFIG))
    _, auto = load_model(tiny_dir, EngineConfig(linear_backend="auto", **CONFIG))
    table = auto.fast.linear_table
    assert rules.fast.linear_table is None and table.source == "measured"
    qkv = f"{64 + 2 * auto.cfg.kv_size}x64 f32"
    assert set(table.entries) == {"320x64 f32", qkv, "64x64 f32", "256x64 f32", "64x128 f32"}
    assert [b for b, _ in table.entries["64x64 f32"]] == [1, 2, 4, 8, 16, 32, 64]  # up to max_num_batched_tokens
    assert [b for b, _ in table.entries["320x64 f32"]] == [1, 2, 4, 8]  # the LM head: up to max_num_seqs
    assert all(backends.BY_NAME[n].precision == "exact" for rows in table.entries.values() for _, n in rows)
    assert all(lin.plan_runs for lin in linear_plan.linears(auto.fast))
    a, r = logits(auto), logits(rules)
    assert float((a - r).abs().max()) <= 1e-4 * float(r.abs().max())
    _, again = load_model(tiny_dir, EngineConfig(linear_backend="auto", **CONFIG))
    assert again.fast.linear_table.source == "cached" and again.fast.linear_table.entries == table.entries


def test_a_fixed_backend_runs_every_linear_layer(tiny_dir):
    _, model = load_model(tiny_dir, EngineConfig(linear_backend="mkl", **CONFIG))
    assert {lin.backend_at(r) for lin in linear_plan.linears(model.fast) for r in (1, 7, 64, 500)} == {"mkl"}
    with pytest.raises(ValueError, match="int4pack is not supported for .* f32"):
        load_model(tiny_dir, EngineConfig(linear_backend="int4pack", **CONFIG))


def test_the_layers_keep_the_c_kernel_where_the_one_call_decode_step_runs():
    """A measured table that gave one layer shape another back-end at 1 row would turn the
    one-call decode step off: up to ONE_CALL_ROWS the layer shapes keep c-int16, the LM head and
    larger buckets keep what was measured."""
    from pdserve.kernels.select import Table

    table = Table(entries={"576x576 Q4_1": [(1, "int4pack"), (2, "c-int16"), (4, "int4pack")],
                           "960x576 Q4_1": [(1, "c-int16"), (2, "c-int16")], "49152x576 Q8_0": [(1, "int4pack")]})
    assert linear_plan.pin_one_call_rows(table, {"576x576 Q4_1", "960x576 Q4_1"}, "int16") == ["576x576 Q4_1"]
    assert table.entries["576x576 Q4_1"] == [(1, "c-int16"), (2, "c-int16"), (4, "int4pack")]
    assert table.entries["960x576 Q4_1"] == [(1, "c-int16"), (2, "c-int16")] and table.entries["49152x576 Q8_0"] == [(1, "int4pack")]


def _noisy_int8(monkeypatch) -> str:
    """A reduced-precision back-end that rounds W to 2 bits per channel: it must fail the gate."""

    def bind(w):
        scale = w.abs().amax(1, keepdim=True) / 1.5
        coarse = torch.round(w / scale).clamp(-1, 1) * scale
        return lambda x, out=None: torch.nn.functional.linear(x, coarse)

    coarse = backends.Backend("int8pack", "int8", backends.ANY_ROWS, 1.0, bind, backends.FLOAT[2].twin)
    monkeypatch.setattr(backends, "FLOAT", tuple(coarse if b.name == "int8pack" else b for b in backends.FLOAT))
    monkeypatch.setitem(backends.BY_NAME, "int8pack", coarse)
    return "int8pack"


def test_teacher_forced_gate_passes_exact_and_refuses_coarse(tiny_dir, monkeypatch):
    _, model = load_model(tiny_dir, EngineConfig(**CONFIG))
    exact = linear_plan.teacher_forced_check(model, tiny_dir, "onednn", "int16", SEQS)
    assert exact["passed"] and exact["top1"] == 1.0 and exact["kl"] < 1e-6 and exact["positions"] == sum(len(s) - 1 for s in SEQS)
    name = _noisy_int8(monkeypatch)
    bad = linear_plan.teacher_forced_check(model, tiny_dir, name, "int16", SEQS)
    assert not bad["passed"] and (bad["top1"] < linear_plan.MIN_TOP1 or bad["kl"] > linear_plan.MAX_KL), bad
    assert logits(model).shape[0] == exact["positions"]  # the check put the model's own back-ends back


def test_auto_reduced_leaves_out_a_precision_that_fails_the_gate(tiny_dir, monkeypatch):
    name = _noisy_int8(monkeypatch)
    seen = []
    check = linear_plan.teacher_forced_check
    monkeypatch.setattr(linear_plan, "teacher_forced_check", lambda m, s, n, a: seen.append(n) or check(m, s, n, a, SEQS))
    _, model = load_model(tiny_dir, EngineConfig(linear_backend="auto-reduced", **CONFIG))
    used = {n for rows in model.fast.linear_table.entries.values() for _, n in rows}
    assert name in seen and name not in used
    assert ("onednn-bf16" in seen) == backends.native_bf16()
    seen.clear()
    load_model(tiny_dir, EngineConfig(linear_backend="auto-reduced", **CONFIG))
    assert seen == []  # the gate's figures were cached
