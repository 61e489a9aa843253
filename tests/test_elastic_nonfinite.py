"""``FaultTolerant(reject_nonfinite=True)``: a rank's non-finite gradients are left out of the step.

Multi-process tests run real trainers (tests/jobs/elastic_worker.py) as tests/test_elastic.py does;
``--fault nonfinite:STEP`` puts a NaN and an inf into one process's gradients of that step during
backward, so that they are reduced too. The references do not come from gradsync: a
single-process replay of the committed steps in which the test itself removes the poisoned
process's batch (read from that process's own log), and two negative controls (that batch
averaged in; left out but the sum divided by every rank). Single-process tests check the pieces:
the finiteness check, the guard's word in the vote, the one-pass divisor.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from gradsync.elastic.nonfinite import NonFiniteGradients, NonFiniteGuard, check_options, first_nonfinite
from gradsync.engine.divisor import Divisor

from elastic_support import ElasticJob, committed_batches, max_difference, replay

STEPS = 8
TOLERANCE = 1e-5
pytestmark = pytest.mark.timeout(90)


def _seeds_of(out: Path, name: str) -> dict[int, int]:
    """Step -> the seed of the batch process ``name`` trained on, from its own log."""
    entries = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
    return {e["step"]: e["seed"] for e in entries if "seed" in e}


def _without(batches: dict[int, set[int]], seeds: dict[int, int], steps: list[int]) -> dict[int, set[int]]:
    kept = {step: set(seeds_of_step) for step, seeds_of_step in batches.items()}
    for step in steps:
        kept[step].discard(seeds[step])
    return kept


def _weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.pt")


def test_a_rank_with_nonfinite_gradients_is_left_out_of_that_step_and_named(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, "nonfinite", replicas=3, steps=STEPS, reject_nonfinite="")
    job.start_with_last_failing(["a", "b"], "c", "nonfinite:3")  # c is rank 2
    results = job.finish(["a", "b", "c"], timeout_s=60)
    assert all(r["identical"] and r["step"] == STEPS and r["world_size"] == 3 for r in results), results
    assert len({r["fingerprint"] for r in results}) == 1  # every replica, c too, bitwise the same
    for result in results:
        assert result["pid"] == job.procs[result["name"]].pid  # nobody restarted
        (entry,) = result["history"]
        assert entry["reason"] == "non-finite gradients" and entry["step"] == 3 and entry["excluded"] == [2]
        assert entry["parameter"] == "3.weight" and entry["kept"] == 2, entry  # 5.bias holds an inf too: later
    assert "non-finite local gradients on rank 2 ('3.weight')" in job.log("a")
    assert "This rank's batch of the step is lost" in job.log("c")

    batches = committed_batches(tmp_path)
    assert [len(batches[s]) for s in range(STEPS)] == [3] * STEPS  # every process applied every step
    without_c = _without(batches, _seeds_of(tmp_path, "c"), [3])
    reference = replay(tmp_path, STEPS, batches=without_c)
    differences = [max_difference(reference, _weights(tmp_path, name)) for name in ("a", "b", "c")]
    assert max(differences) < TOLERANCE, differences
    # Negative controls: c's batch (its clean gradient) averaged in, or left out but divided by 3.
    averaged_in = replay(tmp_path, STEPS, batches=batches)
    divided_by_all = replay(tmp_path, STEPS, divisor={3: 3}, batches=without_c)
    assert max_difference(averaged_in, _weights(tmp_path, "a")) > 100 * TOLERANCE
    assert max_difference(divided_by_all, _weights(tmp_path, "a")) > 100 * TOLERANCE


def test_a_run_with_nothing_wrong_excludes_nothing(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, "all-finite", replicas=2, steps=STEPS, reject_nonfinite="")
    for name in ("a", "b"):
        job.start(name)
    results = job.finish(["a", "b"], timeout_s=60)
    assert all(r["history"] == [] and r["identical"] for r in results), results
    assert len({r["fingerprint"] for r in results}) == 1
    batches = committed_batches(tmp_path)
    assert [len(batches[s]) for s in range(STEPS)] == [2] * STEPS
    assert max_difference(replay(tmp_path, STEPS), _weights(tmp_path, "a")) < TOLERANCE


def test_a_rank_left_out_max_exclusions_steps_in_a_row_exits_naming_why(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, "nonfinite-from", replicas=3, steps=STEPS, reject_nonfinite="")
    job.start_with_last_failing(["a", "b"], "c", "nonfinite-from:2")  # c: every step from 2 on
    assert job.wait_for_exit("c", timeout_s=60) != 0
    log = job.log("c")
    assert "NonFiniteGradients: Rank 2: its local gradients were not finite at steps [2, 3, 4]" in log, log[-3000:]
    assert "'3.weight'" in log and "max_exclusions=3" in log
    results = job.finish(["a", "b"], timeout_s=60)
    assert all(r["identical"] and r["step"] == STEPS and r["world_size"] == 2 for r in results), results
    assert len({r["fingerprint"] for r in results}) == 1
    history = results[0]["history"]
    assert [(h["reason"], h.get("step"), h.get("excluded")) for h in history[:3]] == [
        ("non-finite gradients", step, [2]) for step in (2, 3, 4)
    ]
    assert len(history) == 4 and history[3]["world_size"] == 2 and len(history[3]["left_out"]) == 1, history
    seeds_of_c = _seeds_of(tmp_path, "c")
    assert sorted(seeds_of_c) == list(range(5))  # c applied the steps it was left out of, then left
    reference = replay(tmp_path, STEPS, batches=_without(committed_batches(tmp_path), seeds_of_c, [2, 3, 4]))
    for name in ("a", "b"):
        assert max_difference(reference, _weights(tmp_path, name)) < TOLERANCE


def test_misuse_is_refused_naming_why(tmp_path: Path) -> None:
    jobs = {
        "hook": ElasticJob(tmp_path, "misuse-hook", replicas=1, steps=1, reject_nonfinite="", hook="powersgd"),
        "sharded": ElasticJob(tmp_path, "misuse-sharded", replicas=1, steps=1, reject_nonfinite="", sharded=1),
    }
    for name, job in jobs.items():
        job.start(name)
    mixed = ElasticJob(tmp_path, "misuse-mixed", replicas=2, steps=STEPS)  # one rejects, the other does not
    mixed.start("on", reject_nonfinite="")
    mixed.start("off")
    for name, job in jobs.items():
        assert job.wait_for_exit(name, timeout_s=60) != 0, job.log(name)
    assert "ValueError: reject_nonfinite=True cannot be used with a comm hook (powersgd" in jobs["hook"].log("hook")
    assert "ValueError: reject_nonfinite=True cannot be used with a ShardedOptimizer" in jobs["sharded"].log("sharded")
    deadline = time.monotonic() + 60
    while all(proc.poll() is None for proc in mixed.procs.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    mixed.kill_all()  # the one whose value rank 0 has trains on alone
    refused = {"on": "True, the run's members with False", "off": "False, the run's members with True"}
    logs = {name: mixed.log(name) for name in refused}
    assert any(f"ValueError: Rank 1 was built with reject_nonfinite={refused[n]}" in logs[n] for n in refused), logs


# ---------------------------------------------------------------------- the pieces, in this process
@pytest.mark.timeout(10)
def test_the_first_nonfinite_gradient_is_found_in_registration_order() -> None:
    model = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 2), nn.Embedding(5, 2, sparse=True)])
    (model[1](model[0](torch.ones(1, 3))).sum() + model[2](torch.tensor([1])).sum()).backward()
    params = list(model.parameters())
    assert first_nonfinite(params) is None
    params[1].grad = None  # no gradient: skipped
    params[3].grad[0] = float("inf")
    params[2].grad[0, 0] = float("nan")
    assert first_nonfinite(params) == 2
    params[2].grad.zero_(), params[3].grad.zero_()
    params[4].grad = torch.sparse_coo_tensor([[1]], torch.tensor([[float("nan"), 0.0]]), (5, 2), check_invariants=True)
    assert first_nonfinite(params) == 4


class _Run:
    def __init__(self) -> None:
        self.left = False

    def leave(self) -> None:
        self.left = True


@pytest.mark.timeout(10)
def test_the_guard_asks_to_be_left_out_while_a_reduction_counts_it_and_gives_up_after_max() -> None:
    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([1.0, float("nan")])
    guard, run = NonFiniteGuard(True, max_exclusions=2), _Run()
    guard.check([param], ["w"])
    assert guard.vote() == 0
    guard.leave_out([param])
    assert guard.vote() is None and torch.equal(param.grad, torch.zeros(2))
    guard.reduced_again(fixed_divisor=False)  # a redo after a death divided by the whole group: out again
    assert guard.vote() == 0
    guard.leave_out([param])
    guard.reduced_again(fixed_divisor=True)  # zeros under a fixed count: nothing left to correct
    assert guard.vote() is None
    guard.after_step(5, rank=1, run=run)
    param.grad = torch.tensor([float("inf"), 0.0])
    guard.check([param], ["w"])
    guard.leave_out([param])
    with pytest.raises(NonFiniteGradients, match=r"Rank 1: .* at steps \[5, 6\] .*'w'"):
        guard.after_step(6, rank=1, run=run)
    assert run.left
    off = NonFiniteGuard(False, 3)
    off.check([param], ["w"])
    assert off.vote() is None  # off: never asks
    for wrong in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_exclusions must be a positive int"):
            check_options(None, None, False, wrong)


@pytest.mark.timeout(10)
def test_a_redo_divides_by_the_count_given_for_that_pass_only() -> None:
    divisor = Divisor(world_size=3)
    divisor.divide_next_pass_by(2)
    divisor.reset()
    assert divisor.take() == 2.0
    divisor.reset()
    assert divisor.take() == 3.0
    divisor.fixed = 4.0
    divisor.reset()
    assert divisor.take() == 4.0
