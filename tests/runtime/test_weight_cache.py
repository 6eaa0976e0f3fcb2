"""runtime.weight_cache: a GGUF's blocks are read-only views of the file map and what is made of
them (un-permuted Q/K rows, q/k/v and gate/up joined, the 16-row GEMV copy) is made once per node
into cache files every worker maps read-only; the second load maps them without writing, a short
or corrupt file is rebuilt, and the weights and the greedy output equal the private copies'
(PDSERVE_WEIGHT_CACHE=off, the twin)."""
import threading

import pytest
import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.quant import Origin, QuantTensor
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve.runtime.weight_cache import HEADER, WeightCache
from pdserve_client.params import SamplingParams
from tests.helpers import quant_blocks, save_tiny_model, write_gguf

PROMPT = [5, 9, 33, 100, 7, 250, 3]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("weight_cache")
    save_tiny_model(d / "hf", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    write_gguf(d / "m.gguf", d / "hf", "Q4_0")  # the llama arch: Q/K rows permuted in the file
    return d / "m.gguf"


def load(gguf, cache, monkeypatch) -> LLMEngine:
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", str(cache))
    return LLMEngine.load(gguf, EngineConfig(num_blocks=32, block_size=8), progress=False, tokenizer=False)


def greedy(eng) -> list[int]:
    return eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids


def store_of(eng) -> WeightCache:
    stores = {id(w.origin.store): w.origin.store for w in eng.model.quantized.values()}
    assert len(stores) == 1 and None not in [w.origin for w in eng.model.quantized.values()]
    return next(iter(stores.values()))


def cache_files(cache) -> dict:
    return {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in cache.rglob("*.bin")}


def gemv16_expected() -> bool:
    ops = cpu_native.native()
    return ops is not None and ops.has_gemv16


def test_second_load_maps_the_files_the_first_made(gguf, tmp_path, monkeypatch):
    first = load(gguf, tmp_path / "cache", monkeypatch)
    made = store_of(first).built
    kinds = {k.split("(")[0] for k in made}
    assert {"rows", "cat"} <= kinds  # Q/K un-permuted, q/k/v and gate/up joined
    assert ("gemv16" in kinds) == gemv16_expected()
    before = cache_files(tmp_path / "cache")
    assert len(before) == len(made)

    second = load(gguf, tmp_path / "cache", monkeypatch)
    again = store_of(second)
    assert again.built == [] and again.rebuilt == []
    assert set(again.mapped) == set(made)
    assert cache_files(tmp_path / "cache") == before  # nothing rewritten: same files, same mtimes
    assert greedy(second) == greedy(first)


def test_cached_weights_equal_the_private_copies(gguf, tmp_path, monkeypatch):
    shared = load(gguf, tmp_path / "cache", monkeypatch)
    private = load(gguf, "off", monkeypatch)
    assert store_of(shared).built and all(w.origin is None for w in private.model.quantized.values())
    ops = cpu_native.native()
    for name, w in shared.model.quantized.items():
        twin = private.model.quantized[name]
        assert torch.equal(w.raw, twin.raw), name
        if ops is not None:
            a, b = ops.gemv16_copy(w), ops.gemv16_copy(twin)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    assert greedy(shared) == greedy(private)


def test_short_or_corrupt_files_are_rebuilt(gguf, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    want = greedy(load(gguf, cache, monkeypatch))
    short, flipped, other_key = sorted(cache_files(cache))[:3]
    short.write_bytes(short.read_bytes()[:-5])
    data = bytearray(flipped.read_bytes())
    data[HEADER] ^= 0xFF
    flipped.write_bytes(bytes(data))
    data = bytearray(other_key.read_bytes())
    data[20] ^= 0xFF  # inside the key's sha256
    other_key.write_bytes(bytes(data))

    eng = load(gguf, cache, monkeypatch)
    store = store_of(eng)
    assert sorted(store.rebuilt) == sorted(store.built) and len(store.built) == 3
    assert {store.file_of(k) for k in store.built} == {short, flipped, other_key}
    assert "is invalid" in caplog.text
    assert greedy(eng) == want
    assert store_of(load(gguf, cache, monkeypatch)).built == []  # valid again


def _mapping_of(addr: int) -> tuple[str, str]:
    """(permissions, path) of the mapping of this process holding `addr`."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return fields[1], fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"{addr:#x} is in no mapping")


def test_weights_are_read_only_shared_file_maps(gguf, tmp_path, monkeypatch):
    """Every quantized matrix (and its GEMV copy) the kernels read is a read-only shared map of
    the GGUF or of a cache file: a write would fault, and the node's workers share the pages."""
    eng = load(gguf, tmp_path / "cache", monkeypatch)
    ops = cpu_native.native()
    seen = set()
    for name, w in eng.model.quantized.items():
        tensors = [w.raw] + ([ops.gemv16_copy(w)] if ops is not None and ops.gemv16_copy(w) is not None else [])
        for t in tensors:
            perms, path = _mapping_of(t.data_ptr())
            assert perms == "r--s", (name, perms, path)
            assert path == str(gguf.resolve()) or path.startswith(str(tmp_path / "cache")), (name, path)
            seen.add(path == str(gguf.resolve()))
    assert seen == {True, False}  # o_proj / down_proj straight from the GGUF, the joined ones from the cache


def test_two_processes_asking_at_once_make_one_file(tmp_path):
    """flock serialises the makers (two opens of the lock file conflict even in one process)."""
    calls, results = [], {}
    start = threading.Barrier(2)

    def make():
        calls.append(1)
        return (torch.arange(1 << 22) % 251).to(torch.uint8)

    def ask(i):
        store = WeightCache(tmp_path)
        start.wait()
        results[i] = (store.get("the-key", (1 << 12, 1 << 10), make), store.built)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert torch.equal(results[0][0], results[1][0]) and sorted(len(r[1]) for r in results.values()) == [0, 1]


def test_a_fused_matrix_split_and_joined_is_a_view_of_the_file(tmp_path):
    """Phi-3's attn_qkv split into q/k/v at load and joined back by the model: the file's bytes, no copy."""
    w = quant_blocks("Q8_0", 48, 64)
    w = QuantTensor(w.raw, w.qtype, w.shape, Origin(WeightCache(tmp_path), "blk.0.attn_qkv.weight"))
    joined = QuantTensor.cat([w.row_slice(0, 32), w.row_slice(32, 40), w.row_slice(40, 48)])
    assert joined.raw.data_ptr() == w.raw.data_ptr() and joined.shape == w.shape
    assert not list(tmp_path.iterdir())


def test_stale_caches_go_and_an_unusable_root_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a.gguf").write_bytes(b"GGUF" + bytes(60))
    (tmp_path / "b.gguf").write_bytes(b"GGUF" + bytes(90))
    a = WeightCache.for_model(tmp_path / "a.gguf")
    (tmp_path / "a.gguf").unlink()
    b = WeightCache.for_model(tmp_path / "b.gguf")
    assert not a.dir.exists() and b.dir.is_dir()

    (tmp_path / "file").write_bytes(b"")
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", str(tmp_path / "file" / "cache"))
    assert WeightCache.for_model(tmp_path / "b.gguf") is None
    assert "weight cache off" in caplog.text

    (tmp_path / "cache").chmod(0o777)  # others could plant weights there: not used
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", str(tmp_path / "cache"))
    assert WeightCache.for_model(tmp_path / "b.gguf") is None
    assert "not this user's alone" in caplog.text
