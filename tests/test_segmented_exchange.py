"""gloo's reduce-scatter and all-gather sent in segments ([Note: exchanges in segments]).

Checked against a hand computation from every rank's input (each rank rebuilds them all from
seeds), at lengths that are not multiples of a segment, with several exchanges in flight at once
and waited for out of order, and with a peer that dies: the survivor raises within the group's
timeout instead of waiting forever.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gradsync.collectives import segmented
from gradsync.collectives.sharded import start_all_gather, start_reduce_scatter

from harness import run_distributed

SEGMENT = segmented.SEGMENT_BYTES // 4  # fp32 elements per segment
ADDED_TO = 0.5  # what an accumulating shard holds before


def _input(rank: int, numel: int, salt: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * salt + rank))


def _exchanges(numels: list[int], wire: torch.dtype | None) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    # Several exchanges started before any is waited for; waited for last first. Each sums into a
    # separate shard, adding to what it holds (ZeRO-2's accumulation), or into the bucket's own
    # range (ZeRO-1's in-place shard).
    started = []
    for salt, numel in enumerate(numels):
        padded = _input(rank, numel, salt)
        separate = torch.full((numel // world,), ADDED_TO)
        own_range = padded.view(world, -1)[rank]
        started.append((salt, numel, True, separate, start_reduce_scatter(padded, separate, True, None, wire)))
        started.append((salt, numel, False, own_range, start_reduce_scatter(padded, own_range, False, None, wire)))
    for salt, numel, accumulate, shard, pending in reversed(started):
        pending.finish()
        what = "accumulated" if accumulate else "in place"
        expected = _expected_shard(numel, salt, rank, world, wire, accumulate)
        if not torch.equal(shard, expected):
            error = (shard - expected).abs().max()
            problems.append(f"reduce-scatter ({what}) of {numel} on rank {rank}: max error {error}")
        # All-gather back, in place (the shard is already in its range) and into a fresh output.
        flat = torch.zeros(numel)
        flat.view(world, -1)[rank].copy_(shard)
        start_all_gather(flat, flat.view(world, -1)[rank], None).wait()
        fresh = torch.full((numel,), float("nan"))
        start_all_gather(fresh, shard.clone(), None).wait()
        whole = torch.cat([_expected_shard(numel, salt, r, world, wire, accumulate) for r in range(world)])
        for name, got in (("in place", flat), ("fresh", fresh)):
            if not torch.equal(got, whole):
                problems.append(f"all-gather ({name}) of the {what} {numel} on rank {rank} differs")
    return problems


def _expected_shard(
    numel: int, salt: int, owner: int, world: int, wire: torch.dtype | None, accumulate: bool
) -> torch.Tensor:
    """The sum the reduce-scatter promises, bit for bit: every rank's chunk as sent (rounded to the
    wire's dtype), added in rank order in fp32 (to ``ADDED_TO`` when it accumulates)."""
    chunks = [_input(r, numel, salt).view(world, -1)[owner] for r in range(world)]
    chunks = [t if wire is None else t.to(wire) for t in chunks]
    total = torch.full((numel // world,), ADDED_TO) if accumulate else chunks.pop(0).float().clone()
    for chunk in chunks:
        total.add_(chunk)
    return total


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_segments_add_up_to_the_hand_sum(world: int) -> None:
    # One element per rank, less than a segment, several segments and a ragged tail.
    numels = [world, world * 1000, world * (3 * SEGMENT + 17), world * SEGMENT]
    for wire in (None, torch.bfloat16):
        for problems in run_distributed(_exchanges, world, numels, wire):
            assert not problems, problems


def _peer_dies() -> tuple[str, float]:
    rank = dist.get_rank()
    if rank == 1:
        # Dies only once the survivor's exchange is under way and its bounded wait has timed out
        # (a barrier: a collective, matched apart from the exchange's point-to-point segments).
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    pending = start_reduce_scatter(torch.ones(2 * 4 * SEGMENT), torch.empty(4 * SEGMENT), False, None)
    with pytest.raises(RuntimeError, match="Timed out"):  # a bounded wait says so while the peer is silent
        pending.work.wait(timedelta(seconds=0.1))
    dist.barrier()
    with pytest.raises(RuntimeError) as error:
        pending.wait()
    return str(error.value), time.monotonic() - start


@pytest.mark.timeout(120)
def test_a_dead_peer_fails_the_exchange_instead_of_hanging() -> None:
    message, waited = run_distributed(_peer_dies, 2, expect_dead=frozenset({1}), timeout_s=90, pg_timeout_s=20)[0]
    assert waited < 25, (waited, message)
    assert message, "the failure carries gloo's reason"
