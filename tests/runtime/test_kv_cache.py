"""The block manager as plain data, without a model."""
from runtime.kv_cache import BlockManager


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
