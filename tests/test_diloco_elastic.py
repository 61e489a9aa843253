"""Fault-tolerant DiLoCo: a replica SIGKILLed in its inner steps or in an outer exchange costs the
survivors no inner step, and its restarted self is healed from a live peer.

Real replica processes (tests/jobs/diloco_worker.py) around a store hosted here (or etcd); every
run is checked bit for bit against a single-process replay written from torch alone
(tests/diloco_elastic_support.py), with a negative control showing the replay can tell a wrong
heal apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco_elastic_support import STEPS, DiLoCoJob, H, check, check_bitwise, run_with_a_death

from etcd_support import etcd_cluster  # noqa: F401 - a fixture
from harness import run_distributed

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    # The mid-exchange kill runs here with two fragments (outer step 3 syncs fragment 1); with one,
    # it is the etcd test's case (and the benchmark's, 5 runs each on both stores). Streaming
    # (delay 1, H = 4, F = 2): fragment k % 2's exchange starts after inner step 2 (k + 1) and lands
    # one step later; "inner:10" kills after outer step 4's exchange started, before it landed.
    "fault, fragments, delay, merge, wire, dead_at",
    [
        (f"inner:{2 * H + 1}", 1, 0, "mix", "fp32", 2),
        ("exchange:3", 2, 0, "mix", "fp32", 3),
        ("inner:10", 2, 1, "mix", "fp32", 4),
        ("exchange:3", 2, 1, "keep_inner_steps", "fp32", 3),
        ("inner:10", 2, 1, "keep_inner_steps", "int8-feedback", 4),
    ],
    ids=["inner", "exchange-2-fragments", "streaming-in-flight", "streaming-exchange-keep", "streaming-int8-feedback"],
)
def test_survivors_lose_no_inner_step_and_the_restarted_replica_is_healed(
    fault: str, fragments: int, delay: int, merge: str, wire: str, dead_at: int, tmp_path: Path
) -> None:
    name = f"diloco-{fault.replace(':', '-')}-{fragments}-{delay}-{wire}"
    feedback = {"error_feedback": ""} if wire.endswith("-feedback") else {}
    job = DiLoCoJob(
        tmp_path, name, None, sync_every=H, steps=STEPS, await_joiner="", fragments=fragments, delay=delay,
        merge=merge, wire=wire.removesuffix("-feedback"), **feedback,
    )  # fmt: skip
    results = run_with_a_death(job, fault)
    check(tmp_path, results, dead_at)  # bitwise against the replay, which rounds as the wire does
    if feedback:
        # The joiner starts with no residuals, its source had some; every replica has its own at the end.
        commits = [json.loads(line) for r in results for line in (tmp_path / f"{r['name']}.jsonl").open()]
        joined = next(c for c in commits if "joined" in c)
        at_source = next(
            c for c in commits if c["uuid"] == joined["source"] and c.get("outer_step") == joined["joined"] - 1
        )
        assert joined["residuals"] == 0.0 < at_source["residuals"], (joined, at_source)
        assert all(
            c["residuals"] > 0 for c in commits if c.get("outer_step") == max(c.get("outer_step", 0) for c in commits)
        )
        # Negative control: the replay without the feedback does not match.
        with pytest.raises(AssertionError, match="parameters differ|theta_global differs"):
            check_bitwise(tmp_path, results, error_feedback=False)
    # The exchange overlapped inner steps only where asked: after `delay` steps per outer step.
    for result in results:
        assert (result["in_flight_after_steps"] > 0) == (delay > 0), result
    if delay:
        # Negative control: the replay is sensitive to the merge at landing: replaying the other one
        # must break the bitwise match.
        other = "mix" if merge == "keep_inner_steps" else "keep_inner_steps"
        with pytest.raises(AssertionError, match="parameters differ|theta_global differs"):
            check_bitwise(tmp_path, results, merge=other)
    if fault.startswith("inner") and not delay:
        # Negative control: the replay is sensitive to what the joiner was healed with. Claiming it
        # was healed from the other survivor (the same parameters after the outer step, another
        # AdamW state) must break the bitwise match.
        survivors = {r["uuid"] for r in results if r["name"] in ("a", "b")}
        path = tmp_path / "c2.jsonl"
        entries = [json.loads(line) for line in path.read_text().splitlines()]
        for entry in entries:
            if "joined" in entry:
                entry["source"] = next(iter(survivors - {entry["source"]}))
        path.write_text("".join(json.dumps(e) + "\n" for e in entries))
        with pytest.raises(AssertionError, match="parameters differ|theta_global differs"):
            check_bitwise(tmp_path, results)


@pytest.mark.parametrize(
    # H = 4, F = 2: outer step 3 syncs fragment 1, the round's last, so it also averages the buffers. Blocking:
    # the death is in its exchange. Streaming (delay 1): its exchange starts after inner step 8 and lands after
    # step 9; "inner:8" kills in between, with the exchange in flight.
    "fault, delay, merge",
    [("exchange:3", 0, "mix"), ("inner:8", 1, "keep_inner_steps")],
    ids=["exchange", "streaming-in-flight"],
)
def test_buffers_are_averaged_in_the_decided_exchange_and_redone_among_survivors(
    fault: str, delay: int, merge: str, tmp_path: Path
) -> None:
    """A BatchNorm model ([Note: buffers in a decided exchange]): the running statistics of every replica
    match the replay bit for bit, which averages the contributors' buffers at each round's last landing,
    the round cut off by the death averaged over the two survivors."""
    name = f"diloco-bn-{fault.replace(':', '-')}-{delay}"
    job = DiLoCoJob(
        tmp_path, name, None, sync_every=H, steps=STEPS, await_joiner="", fragments=2, delay=delay, merge=merge,
        batchnorm="",
    )  # fmt: skip
    results = run_with_a_death(job, fault)
    check(tmp_path, results, dead_at=3)  # bitwise, buffers included (the model's state_dict)
    # Negative control: the replay without the buffer averaging does not match (the running statistics).
    with pytest.raises(AssertionError, match=r"parameters differ from the replay \(1\.running_"):
        check_bitwise(tmp_path, results, average_buffers=False)


def test_on_etcd_the_training_thread_asks_the_store_nothing_between_outer_steps(
    etcd_cluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    # int8 on the wire: the replay rounds as the wire does (by hand), so this run is checked bitwise too.
    job = DiLoCoJob(tmp_path, "diloco-etcd", etcd_cluster, sync_every=H, steps=STEPS, await_joiner="", wire="int8")
    results = run_with_a_death(job, "exchange:2")
    check(tmp_path, results, dead_at=2)
    for result in results:
        counts = result["requests_after_step"]
        inner_only = [(a, b) for (_, a), (step, b) in zip(counts, counts[1:]) if step % H != 0]
        assert inner_only and all(a == b for a, b in inner_only), (result["name"], counts)
        if result["name"] != "c2":  # negative control: the counter counts this thread's requests (settling
            assert counts[-1][1] > counts[0][1], (result["name"], counts)  # outer step 2, admitting c2)


def _misuse() -> list[str]:
    import torch
    from torch import nn

    from gradsync import DistributedDataParallel as DDP
    from gradsync.elastic import init, serve
    from gradsync.elastic_diloco import FaultTolerantDiLoCo

    store = serve("127.0.0.1", 0)
    init(store=f"127.0.0.1:{store.port}", run_id="misuse", replicas=1, timeout_s=5.0)
    errors = []
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    try:
        FaultTolerantDiLoCo(DDP(model), torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    except ValueError as error:
        errors.append(str(error))
    outer = FaultTolerantDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    for _ in range(2):  # one outer step among one replica: decided by a vote of one
        model(torch.ones(2, 4)).sum().backward()
        outer.step()
    errors.append(f"outer steps {outer.outer_steps}")
    try:
        with outer.outer.join():
            for _ in range(2):
                model(torch.ones(2, 4)).sum().backward()
                outer.step()
    except RuntimeError as error:
        errors.append(str(error))
    outer.close()
    return errors


def test_what_is_not_offered_is_refused_by_name() -> None:
    errors = run_distributed(_misuse, 1, isolated=True, timeout_s=60)[0]
    assert len(errors) == 3, errors
    assert "not given an island" in errors[0] and "island='name'" in errors[0] and "run.island_group" in errors[0]
    assert errors[1] == "outer steps 1"
    assert "outer.join()" in errors[2] and "close()" in errors[2]
