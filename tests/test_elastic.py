"""Fault-tolerant mode: the survivors of a death go on, and a replacement is healed from them.

Each test runs real trainer processes (tests/jobs/elastic_worker.py) around a store hosted here,
kills or stops one on cue, and checks against references that do not come from gradsync:
- a single-process replay of exactly the committed steps and the batches their members
  contributed (final weights equal to float tolerance, no step missing);
- sha256 digests of every parameter and optimizer-state tensor, equal on every survivor;
- the survivors are the processes started at the beginning (never restarted).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradsync.elastic import serve

from elastic_support import ElasticJob, committed_batches, max_difference, replay

STEPS = 10
TOLERANCE = 1e-5
pytestmark = pytest.mark.timeout(90)


def _check_survivors(job: ElasticJob, out: Path, names: list[str], steps: int, world: int, divisor: int | None = None):
    results = job.finish(names, timeout_s=60)
    for result in results:
        assert result["pid"] == job.procs[result["name"]].pid  # never restarted
        assert result["step"] >= steps and result["world_size"] == world
        assert result["identical"], result
    assert len({r["fingerprint"] for r in results}) == 1
    reference = replay(out, results[0]["step"], divisor)
    for name in names:
        assert max_difference(reference, torch.load(out / f"{name}.pt")) < TOLERANCE
    return results


@pytest.mark.parametrize("phase", ["forward", "backward", "reduction", "between"])
def test_after_a_kill_in_any_phase_the_survivors_commit_every_step(phase: str, tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, f"kill-{phase}", replicas=3, steps=STEPS)
    for name in ("a", "b"):
        job.start(name)
    job.start("c", fault=f"{phase}:4")
    results = _check_survivors(job, tmp_path, ["a", "b"], STEPS, 2)
    history = results[0]["history"]
    assert [h["world_size"] for h in history] == [2] and len(history[0]["left_out"]) == 1
    batches = committed_batches(tmp_path)
    # Only the dead rank's batch of the interrupted step is lost ("between": it died after committing).
    lost_at = 5 if phase == "between" else 4
    assert [len(batches[s]) for s in range(STEPS)] == [3] * lost_at + [2] * (STEPS - lost_at)


def test_two_ranks_killed_at_once(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, "kill-two", replicas=4, steps=STEPS)
    for name in ("a", "b"):
        job.start(name)
    for name in ("c", "d"):
        job.start(name, fault="backward:4")
    results = _check_survivors(job, tmp_path, ["a", "b"], STEPS, 2)
    assert sum(len(h["left_out"]) for h in results[0]["history"]) == 2


def test_a_replacement_with_other_buckets_is_healed_from_a_survivor(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, "heal", replicas=3, steps=STEPS, final_world=3)
    for name in ("a", "b"):
        job.start(name)
    job.start("c", fault="backward:3")
    job.wait_for_exit("c", timeout_s=60)
    # A restarted replica, configured with other bucket caps than its peers (one bucket instead of several).
    job.start("d", bucket_cap_mb=25)
    results = _check_survivors(job, tmp_path, ["a", "b", "d"], STEPS, 3)
    joined = json.loads((tmp_path / "d.json").read_text())["history"]
    assert joined[0]["reason"] == "joined and healed"
    assert [h["world_size"] for h in results[0]["history"]] == [2, 3]


def test_the_joiner_retries_when_its_heal_source_dies(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, "heal-dies", replicas=3, steps=STEPS, await_joiner="")
    job.start("a", fault="heal")  # rank 0: the heal source of the joiner, dies as it starts sending
    job.wait_arrivals(1)
    job.start("b")
    job.start("c", fault="backward:3")
    job.wait_for_exit("c", timeout_s=60)
    job.start("d")
    _check_survivors(job, tmp_path, ["b", "d"], STEPS, 2)


@pytest.mark.parametrize("phase", ["hang", "hang-forward"])
def test_a_hung_rank_is_left_behind(phase: str, tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, phase, replicas=3, steps=STEPS)
    for name in ("a", "b"):
        job.start(name)
    job.start("c", fault=f"{phase}:4")
    job.wait_stopped("c", timeout_s=60)
    stopped = time.monotonic()
    results = _check_survivors(job, tmp_path, ["a", "b"], STEPS, 2)
    # Mid-backward the bucket waits watch the heartbeats: 1.5 s, then forming, healing and the redo. Before
    # forward the survivors block in the buffer broadcast, which only the 5 s collective timeout ends.
    assert results[0]["history"][0]["seconds"] < 5.0
    assert time.monotonic() - stopped < (20 if phase == "hang" else 30)


@pytest.mark.slow
def test_a_forced_disagreement_on_the_last_bucket_ends_in_one_decision(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, "disagree", replicas=3, steps=STEPS)
    job.start("a")
    job.start("b", fault="disagree:4")  # b's last bucket fails; a and c complete theirs or wait
    job.start("c")
    results = _check_survivors(job, tmp_path, ["a", "b", "c"], STEPS, 3)
    history = results[0]["history"]
    assert len(history) == 1 and history[0]["left_out"] == [] and "aborted" in history[0]["reason"]
    assert [len(v) for v in committed_batches(tmp_path).values()] == [3] * STEPS  # nothing lost: redone by all


def test_a_vote_completed_by_the_others_but_lost_on_one_member_commits_there_too(tmp_path: Path) -> None:
    """The others committed step 4 by their vote and went on; c learns it through the store
    ([Note: settling a step]), applies it too, and the step after is redone by all three."""
    job = ElasticJob(tmp_path, "vote-lost", replicas=3, steps=STEPS)
    job.start_with_last_failing(["a", "b"], "c", "vote-lost:4")
    results = _check_survivors(job, tmp_path, ["a", "b", "c"], STEPS, 3)
    reasons = {r["name"]: [h["reason"] for h in r["history"]] for r in results}
    assert reasons["c"] == ["the commit vote failed"], reasons
    assert [len(reasons[n]) for n in ("a", "b")] == [1, 1] and "aborted" in reasons["a"][0], reasons
    assert [len(v) for v in committed_batches(tmp_path).values()] == [3] * STEPS  # every step once, by all


def test_a_member_taken_for_dead_right_after_its_vote_has_that_step_revoked_and_is_healed(tmp_path: Path) -> None:
    """a and b lose their vote of step 4 and settle it; c, stopped right after its own vote, is taken
    for dead: they abort the step and redo it without c. c, resumed, finds its commit revoked in the
    store ([Note: settling a step]), joins again and is healed."""
    job = ElasticJob(tmp_path, "revoked", replicas=3, steps=STEPS, final_world=3)
    for name in ("a", "b"):
        job.start(name, fault="vote-lost:4")
    job.wait_arrivals(2)
    job.start("c", fault="hang-after-vote:4")
    job.wait_stopped("c", timeout_s=60)
    time.sleep(4)  # a and b take c for dead (1.5 s), abort step 4 and redo it
    job.procs["c"].send_signal(signal.SIGCONT)
    results = _check_survivors(job, tmp_path, ["a", "b", "c"], STEPS, 3)
    reasons = {r["name"]: [h["reason"] for h in r["history"]] for r in results}
    assert reasons["c"][0].startswith("revoked: step 4 was aborted") and "joined and healed" in reasons["c"], reasons
    batches = committed_batches(tmp_path)
    assert [len(batches[s]) for s in range(5)] == [3, 3, 3, 3, 2], batches  # c's step 4 is not a committed one


def test_powersgd_state_is_healed_across_a_reconfiguration(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, "powersgd", replicas=3, steps=STEPS, final_world=3, hook="powersgd")
    for name in ("a", "b"):
        job.start(name)
    job.start("c", fault="backward:4")
    job.wait_for_exit("c", timeout_s=60)
    job.start("d")
    results = job.finish(["a", "b", "d"], timeout_s=60)
    assert len({r["fingerprint"] for r in results}) == 1 and all(r["identical"] for r in results)
    assert len({r["hook"] for r in results}) == 1 and results[0]["hook"]  # the same Q matrices and iteration
    assert sorted(committed_batches(tmp_path)) == list(range(results[0]["step"]))


def test_a_fixed_divisor_divides_by_the_configured_count(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, "fixed", replicas=3, steps=STEPS, divisor=3)
    for name in ("a", "b"):
        job.start(name)
    job.start("c", fault="backward:4")
    _check_survivors(job, tmp_path, ["a", "b"], STEPS, 2, divisor=3)


def test_fewer_survivors_than_min_replicas_is_an_error_naming_the_dead_rank(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, "min", replicas=3, steps=STEPS, min_replicas=3)
    job.start_with_last_failing(["a", "b"], "c", fault="backward:4")  # the victim is rank 2
    for name in ("a", "b"):
        assert job.wait_for_exit(name, timeout_s=60) != 0
        assert "Rank(s) [2] of generation 0 died" in job.log(name) and "min_replicas=3" in job.log(name)
    job.kill_all()


def test_misuse_is_refused_with_a_message_saying_what_to_do(tmp_path: Path) -> None:
    store = serve("127.0.0.1", 0)
    script = Path(__file__).parent / "jobs" / "elastic_misuse.py"
    done = subprocess.run(
        [sys.executable, str(script), f"127.0.0.1:{store.port}"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["no store"].startswith("ValueError") and "GRADSYNC_STORE" in found["no store"]
    assert found["no replicas"].startswith("ValueError") and "GRADSYNC_REPLICAS" in found["no replicas"]
    assert "min_replicas must be between 1 and replicas (1)" in found["min above replicas"]
    assert "is not host:port" in found["bad address"]
    assert found["bucket views"].startswith("ValueError") and "gradient_as_bucket_view=True" in found["bucket views"]
    assert found["desync detection"].startswith("ValueError") and "Unset GRADSYNC_DEBUG" in found["desync detection"]
    later = found["desync detection later"]  # switched on once the mode runs: refused as well
    assert later.startswith("ValueError") and "fault-tolerant mode" in later
    assert found["not gradsync"].startswith("TypeError") and "Linear" in found["not gradsync"]
    assert "divisor must be 'survivors' or a positive int" in found["bad divisor"]
    assert "comm hooks divide by the group's size" in found["fixed divisor with a hook"]
    assert found["unknown hook state"].startswith("TypeError") and "object" in found["unknown hook state"]
    assert "found no reduced gradients" in found["step before backward"]
    assert found["one replica trains"] == "True step_count=1 world=1"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_demo_kills_a_replica_restarted_by_its_torchrun_and_heals_it() -> None:
    """``make demo-elastic``: one torchrun per replica, a store outside them, a real restart."""
    demo = Path(__file__).parent.parent / "examples" / "elastic_demo.py"
    done = subprocess.run([sys.executable, str(demo)], capture_output=True, text=True, timeout=220)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "[victim] SIGKILL in the middle of backward" in output
    assert "world size 2 (generation 1)" in output  # the survivors went on without it
    assert "[joiner] healed from a live peer" in output  # torchrun restarted it; it joined
    assert output.count("replicas identical: True") == 3
    assert "same accuracy as the replay: True" in output
    assert "replica exit codes: [0, 0, 0]" in output
