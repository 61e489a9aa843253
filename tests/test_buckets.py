"""Bucket policy, without processes: sizes, caps, keys, order."""

from __future__ import annotations

import pytest

from gradsync.buckets import MIB, ParamInfo, assign_buckets, bucket_caps_bytes


def _params(*nbytes: int, key: str = "f32") -> list[ParamInfo]:
    return [ParamInfo(n, key) for n in nbytes]


def test_bucket_closes_when_size_reaches_cap() -> None:
    params = _params(40, 40, 40, 40, 40)
    # caps of 100 bytes: 40+40 < 100, +40 = 120 >= 100 closes; the rest stays open.
    assert assign_buckets(params, [4, 3, 2, 1, 0], [100]) == [[4, 3, 2], [1, 0]]


def test_first_cap_then_last_cap_for_every_later_bucket() -> None:
    params = _params(*[10] * 10)
    buckets = assign_buckets(params, list(reversed(range(10))), [10, 30])
    assert buckets == [[9], [8, 7, 6], [5, 4, 3], [2, 1, 0]]


def test_dtypes_never_share_a_bucket() -> None:
    params = [ParamInfo(8, "f32"), ParamInfo(8, "f64"), ParamInfo(8, "f32"), ParamInfo(8, "f64")]
    buckets = assign_buckets(params, [3, 2, 1, 0], [1000])
    assert sorted(map(sorted, buckets)) == [[0, 2], [1, 3]]
    # launch order follows the first member in the visiting order
    assert buckets == [[3, 1], [2, 0]]


def test_sparse_parameter_gets_a_bucket_of_its_own() -> None:
    params = [ParamInfo(8, "f32"), ParamInfo(8, "f32", sparse=True), ParamInfo(8, "f32")]
    assert assign_buckets(params, [2, 1, 0], [1000]) == [[2, 0], [1]]


def test_default_caps_are_one_mib_then_25() -> None:
    assert bucket_caps_bytes(None, None) == [MIB, 25 * MIB]
    assert bucket_caps_bytes(2, None) == [2 * MIB]
    assert bucket_caps_bytes(None, [1, 2, 3]) == [MIB, 2 * MIB, 3 * MIB]


def test_every_parameter_is_assigned_exactly_once() -> None:
    params = [ParamInfo(n, "f32" if n % 3 else "f64") for n in range(1, 50)]
    order = list(reversed(range(len(params))))
    buckets = assign_buckets(params, order, [20, 60])
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(params)))


def test_non_positive_cap_is_rejected() -> None:
    with pytest.raises(ValueError, match="positive"):
        assign_buckets(_params(1), [0], [0])
