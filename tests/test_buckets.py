"""Bucket policy, without processes: sizes, caps, keys, order."""

from __future__ import annotations

import pytest

from gradsync.engine.buckets import MIB, ParamInfo, assign_buckets, bucket_caps_bytes


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
    # launch order follows the last member in the visiting order
    assert buckets == [[3, 1], [2, 0]]


def test_sparse_parameter_gets_a_bucket_of_its_own() -> None:
    params = [ParamInfo(8, "f32"), ParamInfo(8, "f32", sparse=True), ParamInfo(8, "f32")]
    # The sparse bucket can start when parameter 1 is ready; the dense one only after 0.
    assert assign_buckets(params, [2, 1, 0], [1000]) == [[1], [2, 0]]


def test_launch_order_is_by_last_member() -> None:
    params = [ParamInfo(8, "f32"), ParamInfo(8, "f64"), ParamInfo(8, "f32"), ParamInfo(8, "f64")]
    # f64 bucket [1, 3] opens first but completes last (position 3); f32 [2, 0] completes at 2.
    assert assign_buckets(params, [1, 2, 0, 3], [1000]) == [[2, 0], [1, 3]]


def test_lone_oversized_parameters_travel_alone() -> None:
    # weight/bias pairs visited bias first, as a backward through Linear layers produces them
    params = [ParamInfo(1000, "f32"), ParamInfo(16, "f32")] * 3  # 0 W, 1 b, 2 W, 3 b, 4 W, 5 b
    order = [5, 4, 3, 2, 1, 0]
    assert assign_buckets(params, order, [100]) == [[5, 4], [3, 2], [1, 0]]
    # the biases share one bucket, launched once its last member (1) is ready, before 0
    assert assign_buckets(params, order, [100], lone_oversized=True) == [[4], [2], [5, 3, 1], [0]]


def test_lone_oversized_measures_against_the_cap_that_applies() -> None:
    params = _params(30, 30, 30, 30)
    # first cap 40: nobody is oversized yet; the bucket [3, 2] closes at 60 >= 40; then cap 50
    assert assign_buckets(params, [3, 2, 1, 0], [40, 50], lone_oversized=True) == [[3, 2], [1, 0]]
    # first cap 20: parameter 3 is oversized and goes alone, which also uses up the first cap
    assert assign_buckets(params, [3, 2, 1, 0], [20, 50], lone_oversized=True) == [[3], [2, 1], [0]]


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
