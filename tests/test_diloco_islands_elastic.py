"""Fault-tolerant DiLoCo over islands: a member that dies ends its island, which restarts; the other islands
lose no inner step and heal it.

Each island is a torchrun of tests/jobs/diloco_worker.py processes training one replica with a gradsync
DDP over the island's group (tests/island_support.py). Every run is checked bit for bit against the
single-process replay of tests/diloco_elastic_support.py (each island replayed as one replica whose
gradient averages its members' as the DDP does), with negative controls.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco_elastic_support import H, check_bitwise, read_logs
from island_support import IslandJob, died_at, island_lost

from etcd_support import etcd_cluster  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(180)

HEARTBEAT_S = 1.5  # the worker's heartbeat_timeout_s
STEPS = 16


def run_islands(job: IslandJob, sizes: tuple[int, int], fault: str, victim: int) -> list[dict]:
    """Islands A (slot 0) and B (slot 1); B's member ``victim`` meets ``fault`` in its first incarnation."""
    job.start_island("A", 0, sizes[0])
    job.wait_arrivals(sizes[0])
    job.start_island("B", 1, sizes[1], fault=fault, victim=victim)
    return job.finish_islands(["A", "B"], timeout_s=150)


def check_islands(job: IslandJob, results: list[dict], dead_at: int, lost_rank: int, atol: float = 0.0) -> None:
    """What the issue asks of a run where island B lost a member at outer step ``dead_at``."""
    logs = read_logs(job.out)
    a = {r["uuid"] for r in results if r["name"].startswith("A-")}
    b_new = {r["uuid"] for r in results if r["name"].startswith("B-") and r["name"].endswith("-r1")}
    assert len(a) == 1 and len(b_new) == 1, results  # one replica each: its members agree on who they are
    (island_a,), (island_b,) = a, b_new
    # No inner step lost: island A contributed to every committed outer step, alone at the cut-off one.
    assert all(island_a in c for c in logs.commits.values()), logs.commits
    assert logs.commits[dead_at] == [island_a], logs.commits
    joined_at, source = logs.joins[island_b]
    assert source == island_a and dead_at < joined_at <= len(logs.commits) - 2, (logs.joins, len(logs.commits))
    assert all(island_b in logs.commits[k] for k in range(joined_at, len(logs.commits)))
    assert all(r["identical"] for r in results), results
    # A SIGKILLed member fails its worker: torchrun names it and stops its mates at once (the watch is for hangs).
    assert f"failed (exitcode: -9) local_rank: {lost_rank}" in job.log("B"), job.log("B")[-3000:]
    check_bitwise(job.out, [r for r in results if r["member"] == 0], atol=atol)


@pytest.mark.parametrize(
    # H = 4. F = 2: outer step 3 syncs fragment 1. Streaming (delay 1, F = 2): fragment k % 2's exchange starts
    # after inner step 2 (k + 1) and lands one step later; "inner:10" kills with outer step 4's in flight.
    "fault, dead_at, fragments, delay",
    [(f"inner:{2 * H + 1}", 2, 1, 0), ("exchange:3", 3, 2, 0), ("inner:10", 4, 2, 1), ("gather:2", 2, 1, 0)],
    ids=["inner", "exchange-2-fragments", "streaming-in-flight", "island-gather"],
)
def test_a_member_dies_its_island_restarts_the_other_loses_nothing(
    fault: str, dead_at: int, fragments: int, delay: int, tmp_path: Path
) -> None:
    job = IslandJob(
        tmp_path, f"islands-{fault.replace(':', '-')}", None, replicas=2, sync_every=H, steps=STEPS,
        await_joiner="", fragments=fragments, delay=delay,
    )  # fmt: skip
    results = run_islands(job, (2, 2), fault, victim=1)
    check_islands(job, results, dead_at, lost_rank=1)
    if fault.startswith("inner"):
        # Negative control: the replay told that the cut-off step averaged both islands (the dead island's
        # outer gradient in, dividing by two) must not match.
        b_old = json.loads(next(tmp_path.glob("B-m0-r0.jsonl")).read_text().splitlines()[0])["uuid"]
        for path in tmp_path.glob("*.jsonl"):
            entries = [json.loads(line) for line in path.read_text().splitlines()]
            for entry in entries:
                if entry.get("outer_step") == dead_at:
                    entry["contributors"] = entry["contributors"] + [b_old]
            path.write_text("".join(json.dumps(e) + "\n" for e in entries))
        with pytest.raises(AssertionError, match="parameters differ|theta_global differs"):
            check_bitwise(tmp_path, [r for r in results if r["member"] == 0])


def test_a_hung_member_ends_its_island_within_the_heartbeat_timeout(tmp_path: Path) -> None:
    """SIGSTOP: nothing fails, a collective with it would wait for the group's timeout (5 s here). Its mate's
    watch names it and exits within the heartbeat timeout; island A goes on alone, losing no inner step."""
    job = IslandJob(tmp_path, "islands-hang", None, replicas=2, sync_every=H, steps=STEPS)
    job.start_island("A", 0, 2)
    job.wait_arrivals(2)
    job.start_island("B", 1, 2, restarts=0, fault=f"hang:{2 * H + 1}", victim=1)
    try:
        code = job.procs["A"].wait(timeout=120)
        assert code == 0, job.log("A")[-4000:]
        lost = island_lost(job.log("B"))
        pid, stopped = died_at(tmp_path)
    finally:
        job.kill_all()
        import os
        import signal

        os.kill(pid, signal.SIGKILL)  # the hung member (torchrun, killed here, would have after its grace)
    assert len(lost) == 1 and lost[0][1:] == ("B", 1), job.log("B")[-3000:]
    assert lost[0][0] - stopped < HEARTBEAT_S + 1.0, (lost, stopped)  # the watch polls every period
    logs = read_logs(tmp_path)
    island_a = next(r["uuid"] for r in job.results() if r["name"].startswith("A-"))
    assert all(island_a in c for c in logs.commits.values()) and logs.commits[2] == [island_a], logs.commits
    check_bitwise(tmp_path, [r for r in job.results() if r["member"] == 0])


def test_unequal_islands_on_etcd(etcd_cluster, tmp_path: Path) -> None:  # noqa: F811
    """Islands of 1 and 2 (one slice across; B's second member has no counterpart) around etcd: B's member 0
    dies between its two all-to-alls across; B restarts and is healed from A, a replica of another size."""
    job = IslandJob(tmp_path, "islands-unequal", etcd_cluster, replicas=2, sync_every=H, steps=STEPS, await_joiner="")
    results = run_islands(job, (1, 2), "exchange:2", victim=0)
    check_islands(job, results, dead_at=2, lost_rank=0)


def test_zero_inside_islands_a_restarted_island_is_healed_shard_by_shard(tmp_path: Path) -> None:
    """ZeRO-2 (gradsync.zero.ShardedOptimizer, AdamW) inside 2 islands x 2: B's member 1 dies in its inner steps.
    A's shards follow its DDP to each generation's group keeping their state; B restarts and each of its
    members takes the AdamW state of the ranges it owns from A's members. Against the replay with plain AdamW."""
    job = IslandJob(
        tmp_path, "islands-zero", None, replicas=2, sync_every=H, steps=STEPS, await_joiner="", zero=2
    )  # fmt: skip
    results = run_islands(job, (2, 2), f"inner:{2 * H + 1}", victim=1)
    check_islands(job, results, dead_at=2, lost_rank=1)
    # Negative control: the replay told that B restarted with a fresh AdamW (no shard healed) must not match.
    with pytest.raises(AssertionError, match="parameters differ|theta_global differs"):
        check_bitwise(tmp_path, [r for r in results if r["member"] == 0], heal_inner=False)


def test_zero_inside_unequal_islands_a_restarted_island_is_resharded(tmp_path: Path) -> None:
    """ZeRO-2 inside islands of 1 and 2: B (2 members) restarts after its member 0 died mid-exchange and is
    healed from A, whose one process owns every range: each of B's members takes its half of A's shard
    ([Note: shards healed across islands]), against the replay."""
    job = IslandJob(
        tmp_path, "islands-zero-unequal", None, replicas=2, sync_every=H, steps=STEPS, await_joiner="", zero=2
    )  # fmt: skip
    results = run_islands(job, (1, 2), "exchange:2", victim=0)
    check_islands(job, results, dead_at=2, lost_rank=0)


def test_zero_inside_islands_a_nan_island_is_left_out_and_its_shards_healed(tmp_path: Path) -> None:
    """A NaN written into one member's copy of a parameter (ZeRO-2 inside 2 islands x 2): the island's next
    gradients, shards and parameters turn non-finite; its outer gradient is left out of outer step 2 (named
    on every member), it restarts from theta_global and its members take their AdamW shards from A's."""
    job = IslandJob(tmp_path, "islands-zero-nan", None, replicas=2, sync_every=H, steps=STEPS, zero=2)
    job.start_island("A", 0, 2)
    job.wait_arrivals(2)
    job.start_island("B", 1, 2, fault=f"nan:{2 * H + 1}", victim=1)
    results = job.finish_islands(["A", "B"], timeout_s=150)
    logs = read_logs(tmp_path)
    island_a = next(r["uuid"] for r in results if r["name"].startswith("A-"))
    island_b = next(r["uuid"] for r in results if r["name"].startswith("B-"))
    assert logs.excluded[2] == [island_b] and logs.commits[2] == [island_a], logs
    assert all(logs.excluded[k] == [] and island_b in logs.commits[k] for k in logs.commits if k != 2), logs
    assert len(logs.commits) == STEPS // H  # and B contributes again after it (the re-heal shows there)
    for result in results:  # named on every member of both islands
        entry = next(h for h in result["history"] if h["reason"] == "bad contribution left out")
        assert entry["excluded"] == ["B"] and entry["outer_step"] == 2 and entry["parameters"] == ["0.weight"], entry
    assert all(r["identical"] for r in results), results
    members_0 = [r for r in results if r["member"] == 0]
    check_bitwise(tmp_path, members_0)
    # Negative control: without the re-heal (B going on with its NaN AdamW state) the replay is not finite.
    with pytest.raises(AssertionError, match="parameters differ|theta_global differs"):
        check_bitwise(tmp_path, members_0, heal_inner=False)
