"""Pure bucket assignment: which parameters share a flat buffer.

No ``torch.distributed`` here, only sizes and keys, so the policy can be unit-tested
without processes.

[Note: bucket policy]
Parameters are visited in a given order (reverse registration order at construction,
the observed gradient-ready order after the rebuild). Each ``(device, dtype)`` key
fills its own open bucket; a bucket closes as soon as its size reaches the current
cap, so a bucket may exceed its cap by one tensor (as torch's reducer does). The
first bucket of each key uses the first cap, later ones the last cap. A parameter
that produces sparse gradients always gets a bucket of its own.

With ``lone_oversized`` a dense parameter at least as large as the cap of the bucket it
would join gets a bucket of its own instead, and that bucket stays open for the next
parameters. Such a bucket can be reduced in place in the parameter's ``.grad``
([Note: reducing a lone gradient in place] in in_place.py), which saves copying the
largest gradients in and out; the small parameters around it share a bucket.

Buckets are launched in the order their *last* member is expected to become ready: the
moment a bucket can start. (For buckets that hold a contiguous run of the order, that is
also the order of their first members.)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB


@dataclass(frozen=True)
class ParamInfo:
    """What the bucket policy needs to know about one parameter."""

    nbytes: int
    key: Hashable  # parameters with different keys never share a bucket
    sparse: bool = False


def bucket_caps_bytes(bucket_cap_mb: float | None, bucket_cap_mb_list: Sequence[float] | None) -> list[int]:
    """The cap of bucket 0, 1, 2, ...; the last entry applies to every later bucket."""
    if bucket_cap_mb_list is not None:
        return [int(cap * MIB) for cap in bucket_cap_mb_list]
    if bucket_cap_mb is None:
        return [DEFAULT_FIRST_BUCKET_BYTES, int(DEFAULT_BUCKET_CAP_MB * MIB)]
    return [int(bucket_cap_mb * MIB)]


def assign_buckets(
    params: Sequence[ParamInfo], order: Sequence[int], caps: Sequence[int], lone_oversized: bool = False
) -> list[list[int]]:
    """Group parameter indices into buckets, visiting them in ``order`` ([Note: bucket policy]).

    Returns the buckets in launch order: by the position in ``order`` of their last member.
    """
    if not caps or any(cap <= 0 for cap in caps):
        raise ValueError(f"bucket caps must be positive, got {list(caps)}")
    done: list[tuple[int, list[int]]] = []  # (position of last member, members)
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}  # key -> (members, bytes)
    closed_per_key: dict[Hashable, int] = {}
    last_position: dict[int, int] = {}
    for position, index in enumerate(order):
        last_position[index] = position
        info = params[index]
        if info.sparse:
            done.append((position, [index]))
            continue
        cap = caps[min(closed_per_key.get(info.key, 0), len(caps) - 1)]
        if lone_oversized and info.nbytes >= cap:
            done.append((position, [index]))
            closed_per_key[info.key] = closed_per_key.get(info.key, 0) + 1
            continue
        members, size = open_buckets.get(info.key, ([], 0))
        members.append(index)
        size += info.nbytes
        if size >= cap:
            done.append((position, members))
            closed_per_key[info.key] = closed_per_key.get(info.key, 0) + 1
            open_buckets.pop(info.key, None)
        else:
            open_buckets[info.key] = (members, size)
    done.extend((last_position[members[-1]], members) for members, _ in open_buckets.values())
    done.sort(key=lambda item: item[0])
    return [members for _, members in done]
