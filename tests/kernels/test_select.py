"""The linear back-ends (kernels.backends) against their twins, and the selector (kernels.select)
that times them: a back-end that disagrees with its twin, or fails, is refused and never chosen
however fast it is; a table is cached and read back without timing; PackedLinear dispatches by a
table's rows."""
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import backends, cpu_native, select
from pdserve.kernels.linear import PackedLinear
from pdserve.kernels.quant import QuantTensor

pytestmark = pytest.mark.skipif(cpu_native.native() is None, reason="needs a C compiler for the C kernels")


def random_quant(qtype: str, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return QuantTensor(torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])), qtype, (rows, cols))


WEIGHTS = {"f32": lambda: torch.randn(208, 96, generator=torch.Generator().manual_seed(1)) * 0.05,
           **{q: (lambda q=q: random_quant(q, 208, 96)) for q in ("Q4_0", "Q4_1", "Q8_0")}}


@pytest.mark.parametrize("kind", list(WEIGHTS))
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 130])
def test_every_backend_agrees_with_its_twin(kind, rows):
    """Each back-end that runs here, at row counts on both sides of its kernels' paths (208 outputs:
    tile tails), within its stated tolerance of its float64 twin; the exact ones also within
    float32 rounding of F.linear on the same (dequantized) weight."""
    w = WEIGHTS[kind]()
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    dense = w.dequantize() if isinstance(w, QuantTensor) else w
    ran = []
    for b in backends.for_weight(w):
        run = b.bind(w)
        if run is None or rows > b.max_rows:
            continue
        y = run(x)
        assert y.shape == (rows, 208) and y.dtype == torch.float32
        err = select.disagreement(y, b.twin(x, w), x, w)
        assert err <= b.tol, (b.name, err)
        if b.precision == "exact":
            assert select.disagreement(y, F.linear(x.double(), dense.double()), x, w) <= backends.EXACT_TOL, b.name
        ran.append(b.name)
    must = {"f32": {"c", "onednn", "mkl", "int8pack"}, "Q4_0": {"c-float", "c-int16", "dequant-mkl", "int4pack"},
            "Q4_1": {"c-float", "c-int16", "dequant-mkl", "int4pack"}, "Q8_0": {"c-float", "c-int16", "dequant-mkl"}}[kind]
    if kind != "f32" and cpu_native.native().isa == "avx512":
        must.add("c-int8-vnni")  # the int8 VNNI GEMM, where the loaded variant builds it
    assert must - {n for n in must if backends.BY_NAME[n].max_rows < rows} <= set(ran)
    assert ("onednn-bf16" in ran) == (kind == "f32" and backends.native_bf16())


def _wrong(name: str, fn) -> backends.Backend:
    return backends.Backend(name, "exact", backends.ANY_ROWS, backends.EXACT_TOL, lambda w: (lambda x, out=None: fn(x, w)),
                            lambda x, w: F.linear(x.double(), w.double()))


def test_selector_refuses_a_wrong_backend_however_fast():
    """Three wrong back-ends, each faster than any right one (they return a ready tensor or do a
    tiny product): off by 1e-2 noise, transposed weights, and one that raises. None is ever
    chosen; each is refused with its reason, and the right ones fill the table."""
    w = torch.randn(96, 96, generator=torch.Generator().manual_seed(2)) * 0.05
    ready = {}

    def noisy(x, w):
        if x.shape[0] not in ready:
            ready[x.shape[0]] = F.linear(x, w) + 1e-2 * torch.randn(x.shape[0], w.shape[0])
        return ready[x.shape[0]]  # right only on the first rows it saw, then instant and wrong

    def transposed(x, w):
        return F.linear(x, w.T)

    def broken(x, w):
        raise RuntimeError("no kernel for this shape")

    wrong = (_wrong("noisy", noisy), _wrong("transposed", transposed), _wrong("broken", broken))
    candidates = wrong + tuple(b for b in backends.FLOAT if b.name in ("mkl", "onednn", "c"))
    table = select.choose({"k": w}, {"k": [1, 8, 64]}, {"k": candidates}, lambda k, r: "mkl")
    chosen = {name for _, name in table.entries["k"]}
    assert chosen and chosen <= {"mkl", "onednn", "c"}, table.entries
    refused = table.refused["k"]
    assert set(refused) == {"noisy", "transposed", "broken"}
    assert "disagrees" in refused["noisy"] and "disagrees" in refused["transposed"] and "RuntimeError" in refused["broken"]


def test_table_is_cached_and_read_back_without_timing(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    w = torch.randn(40, 64) * 0.1
    key = select.cache_key({"shapes": {"40x64 f32": [1, 4]}})
    measure = lambda: select.choose({"40x64 f32": w}, {"40x64 f32": [1, 4]}, {"40x64 f32": backends.FLOAT[:3]},  # noqa: E731
                                    lambda k, r: "mkl").to_json()
    doc, hit = select.cached("linear", key, measure)
    assert not hit and (tmp_path / "kernels" / f"linear-{key}.json").is_file()

    def never():
        raise AssertionError("a cache hit must not measure")

    again, hit = select.cached("linear", key, never)
    assert hit and select.Table.from_json(again).entries == select.Table.from_json(doc).entries
    table = select.Table.from_json(again)
    assert [b for b, _ in table.entries["40x64 f32"]] == [1, 4] and table.source == "cached"
    assert select.cache_key({"shapes": {"40x64 f32": [1, 8]}}) != key  # other buckets: another table


def test_packed_linear_dispatches_by_the_table_rows():
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(72, 48, generator=g), torch.randn(72, generator=g)
    lin = PackedLinear(w, b, "auto")
    lin.use([(4, "mkl"), (64, "onednn"), (256, "c")])
    assert [lin.backend_at(r) for r in (1, 4, 5, 64, 65, 256, 1000)] == ["mkl", "mkl", "onednn", "onednn", "c", "c", "c"]
    assert lin.packed is None  # the rules' oneDNN copy is dropped (the table's own is bound)
    for rows in (1, 5, 64, 65, 300):
        x = torch.randn(rows, 48, generator=g)
        assert select.disagreement(lin(x) - b, F.linear(x.double(), w.double()), x, w) <= backends.EXACT_TOL
    with pytest.raises(ValueError, match="int4pack"):
        lin.use([(4, "int4pack")])  # a float weight has no int4 form


def test_table_text_names_runs_of_buckets():
    t = select.Table({"960x576 f32": [(1, "c"), (4, "c"), (8, "onednn"), (64, "onednn"), (128, "mkl")], "8x8 Q4_1": [(1, "c-int16")]})
    assert t.text() == "960x576 f32: 1-4 c, 5-64 onednn, 65+ mkl\n8x8 Q4_1: 1+ c-int16"
    assert t.pick("960x576 f32", 5) == "onednn" and t.pick("960x576 f32", 4000) == "mkl" and t.pick("other", 1) is None


def test_workers_starting_together_measure_once(tmp_path, monkeypatch):
    """A second start that asks while the first measures waits for its table (hit) instead of
    measuring beside it (two timings on the same cores, each distorting the other)."""
    import threading

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    started, release, measured, results = threading.Event(), threading.Event(), [], {}

    def measure(name):
        def run():
            measured.append(name)
            started.set()
            assert release.wait(30)
            return {"by": name}
        return run

    first = threading.Thread(target=lambda: results.update(first=select.cached("linear", "k", measure("first"))))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=lambda: results.update(second=select.cached("linear", "k", measure("second"))))
    second.start()
    second.join(0.2)
    assert second.is_alive()  # held by the first's lock
    release.set()
    first.join(30)
    second.join(30)
    assert measured == ["first"]
    assert results == {"first": ({"by": "first"}, False), "second": ({"by": "first"}, True)}
