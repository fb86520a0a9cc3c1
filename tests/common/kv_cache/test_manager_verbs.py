"""The questions the scheduling policy asks the KV cache: whether tokens fit, whether a slot is free, how full it is."""

import pytest

from lightllm.common.kv_cache import KVCacheManager


@pytest.mark.parametrize("contiguous", [False, True], ids=["token-pool", "contiguous-slots"])
def test_verbs_follow_what_requests_hold(contiguous):
    kv = KVCacheManager(16, 2, 8, "cpu", contiguous_slots=contiguous)
    assert kv.can_allocate(16) and not kv.can_allocate(17) and kv.usage() == 0
    a = kv.add_request()
    kv.extend(a, 5)
    assert kv.can_allocate(11) and not kv.can_allocate(12) and kv.usage() == 5 / 16
    b = kv.add_request()
    assert not kv.has_free_slot()
    kv.extend_each([a, b])
    assert kv.can_allocate(9) and not kv.can_allocate(10) and kv.usage() == 7 / 16
    kv.free_request(a)
    assert kv.has_free_slot() and kv.can_allocate(15) and kv.usage() == 1 / 16
