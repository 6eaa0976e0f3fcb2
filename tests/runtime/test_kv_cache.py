"""The block manager as plain data, without a model; the workers' default KV budget."""
import os

from pdserve.runtime.kv_cache import BlockManager


def test_allocate_free_refcount():
    bm = BlockManager(4, 16)
    a = bm.allocate(3)
    assert len(a) == 3 and bm.free_blocks == 1
    assert bm.allocate(2) is None and bm.free_blocks == 1  # short pool: nothing taken
    bm.share(a[:1])
    bm.free(a)
    assert bm.free_blocks == 3  # a[0] still shared
    bm.free(a[:1])
    assert bm.free_blocks == 4


def test_double_free_is_an_error():
    bm = BlockManager(2, 16)
    a = bm.allocate(1)
    bm.free(a)
    try:
        bm.free(a)
    except ValueError as e:
        assert "freed twice" in str(e)
    else:
        raise AssertionError("double free accepted")


def test_ensure_slots_and_slot_mapping():
    bm = BlockManager(8, 4)
    table = []
    assert bm.ensure_slots(table, 5) and len(table) == 2
    assert bm.ensure_slots(table, 8) and len(table) == 2
    assert bm.slot(table, 5) == table[1] * 4 + 1
    assert not bm.ensure_slots(table, 100) and len(table) == 2


def test_auto_kv_budget_is_2_gib_or_what_a_small_machine_can_spare(tmp_path):
    from pdserve.runtime.config import AUTO_KV_CACHE_MB, auto_kv_cache_mb

    with open("/proc/meminfo") as f:
        available_mib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) // 1024
    shm = os.statvfs("/dev/shm")
    expected = min(AUTO_KV_CACHE_MB, available_mib // 4, shm.f_bavail * shm.f_frsize // 2**20 // 2)
    assert abs(auto_kv_cache_mb() - expected) <= max(64, expected // 20)  # MemAvailable moves a little between the reads
    assert auto_kv_cache_mb(shm_dir=str(tmp_path / "absent")) >= auto_kv_cache_mb()  # no /dev/shm: only the memory cap applies
    assert 16 <= auto_kv_cache_mb() <= AUTO_KV_CACHE_MB
