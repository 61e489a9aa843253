"""Bad contributions are left out, never averaged in ([Note: bad contributions are left out]).

The verdict is a pure function of every process's four numbers: checked by hand first. Then real
replicas (tests/jobs/diloco_worker.py) with a NaN (or a 1000x move) written into one replica's
parameters before an outer step: it is left out, named on every replica, and every replica matches the
single-process replay of tests/diloco_elastic_support.py bit for bit, which averages only the others
and restarts the excluded one from theta_global; the replay that averages it in does not match.
Plain ``DiLoCo`` raises before a non-finite average reaches theta_global.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diloco_elastic_support import DiLoCoJob, H, check_bitwise, read_logs
from gradsync.elastic_diloco.contributions import judge

from harness import run_distributed

pytestmark = pytest.mark.timeout(120)


def _rows(*islands: tuple[float, float, int, int]) -> torch.Tensor:
    return torch.tensor([list(r) for r in islands], dtype=torch.float64)


def test_the_verdict_leaves_out_the_non_finite_and_with_the_ratio_rule_the_outlier() -> None:
    names = ["w", "b"]
    ok, bad = (1, 2.0, -1, 1), (0, float("inf"), 1, 0)
    # A non-finite member excludes its whole island (ranks 2, 3), named by its first bad parameter.
    v = judge(_rows(ok, ok, ok, bad), [[0, 1], [2, 3]], names, None, me=0)
    assert v.excluded == [1] and v.contributors == 1 and not v.mine and v.parameters == {1: "b"} and v.reheal == [1]
    assert judge(_rows(ok, ok, ok, bad), [[0, 1], [2, 3]], names, None, me=2).mine
    # 1000x the others' norm: left out only with the ratio rule, and only with three contributors or more.
    big = (1, 2000.0, -1, 1)
    assert judge(_rows(ok, ok, big), [[0], [1], [2]], names, None, me=0).excluded == []
    ruled = judge(_rows(ok, ok, big), [[0], [1], [2]], names, 10.0, me=0)
    assert ruled.excluded == [2] and "over 10x the median" in ruled.reasons[2] and ruled.contributors == 2
    assert judge(_rows(ok, big), [[0], [1]], names, 10.0, me=0).excluded == []
    # Negative control: nothing wrong, nothing left out.
    assert judge(_rows(ok, ok, ok), [[0], [1], [2]], names, 10.0, me=1).excluded == []


def _three_with(tmp_path: Path, fault: str, **options: object) -> tuple[DiLoCoJob, list[dict]]:
    job = DiLoCoJob(tmp_path, f"bad-{fault.replace(':', '-')}", None, sync_every=H, steps=16, **options)
    job.start("a", slot=0)
    job.start("b", slot=1)
    job.wait_arrivals(2)
    job.start("c", slot=2, fault=fault)
    return job, job.finish(["a", "b", "c"], timeout_s=90)


def _averaged_in_anyway(tmp_path: Path, step: int, culprit: str) -> None:
    """Rewrite the logs as if outer step ``step`` had averaged ``culprit`` in (a negative control)."""
    for path in tmp_path.glob("*.jsonl"):
        entries = [json.loads(line) for line in path.read_text().splitlines()]
        for entry in entries:
            if entry.get("outer_step") == step:
                entry["contributors"], entry["excluded"] = entry["contributors"] + [culprit], []
        path.write_text("".join(json.dumps(e) + "\n" for e in entries))


@pytest.mark.parametrize("fault, options", [(f"nan:{2 * H + 1}", {}), (f"scale:{2 * H + 1}", {"max_norm_ratio": 10})])
def test_a_bad_replica_is_left_out_named_and_restarted_from_theta_global(
    fault: str, options: dict, tmp_path: Path
) -> None:
    job, results = _three_with(tmp_path, fault, **options)
    logs = read_logs(tmp_path)
    c = next(r["uuid"] for r in results if r["name"] == "c")
    assert logs.excluded[2] == [c] and c not in logs.commits[2], logs  # the outer step after the injection
    assert all(logs.excluded[k] == [] for k in logs.commits if k != 2), logs.excluded  # nothing else, ever
    assert all(c in logs.commits[k] for k in logs.commits if k != 2)  # it contributes again at once
    for result in results:  # named on every replica: which one, the step, why (and the parameter)
        entry = next(h for h in result["history"] if h["reason"] == "bad contribution left out")
        assert entry["excluded"] == [c] and entry["outer_step"] == 2, entry
        if fault.startswith("nan"):
            assert entry["parameters"] == ["0.weight"] and "not finite" in entry["why"], entry
        else:
            assert "over 10x the median" in entry["why"], entry
    assert all(r["identical"] for r in results)
    check_bitwise(tmp_path, results)  # the others averaged without it; it restarted from theta_global
    _averaged_in_anyway(tmp_path, 2, c)  # negative control
    with pytest.raises(AssertionError, match="parameters differ|theta_global differs"):
        check_bitwise(tmp_path, results)


def test_a_replica_left_out_too_often_ends_and_the_others_go_on(tmp_path: Path) -> None:
    job = DiLoCoJob(tmp_path, "bad-repeat", None, sync_every=H, steps=16, replicas=2, max_exclusions=1)
    job.start("a", slot=0)
    job.wait_arrivals(1)
    job.start("c", slot=2, fault=f"nan:{2 * H + 1}")
    assert job.wait_for_exit("c", timeout_s=60) != 0
    assert "was left out of 1 outer steps in a row (max_exclusions=1)" in job.log("c"), job.log("c")[-2000:]
    (a,) = job.finish(["a"], timeout_s=60)
    assert a["step"] >= 16 and any(h["reason"].startswith("outer step") for h in a["history"]), a["history"]


def _plain_diloco_with_a_nan() -> str:
    import torch.distributed as dist
    from torch import nn

    from gradsync.diloco import DiLoCo

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, inner, sync_every=2)
    theta = [t.detach().clone() for t in outer.global_parameters]
    model(torch.ones(3, 4)).sum().backward()
    outer.step()
    if dist.get_rank() == 1:
        with torch.no_grad():
            model[2].bias[0] = float("nan")
    model(torch.ones(3, 4)).sum().backward()
    try:
        outer.step()
    except RuntimeError as error:
        assert all(torch.equal(a, b) for a, b in zip(theta, outer.global_parameters)), "theta_global was touched"
        return str(error)
    finally:
        outer.close()
    return "no error"


def test_plain_diloco_raises_on_every_replica_before_a_non_finite_average_is_applied() -> None:
    for message in run_distributed(_plain_diloco_with_a_nan, 2, timeout_s=60):
        assert "replica(s) [1]" in message and "'2.bias'" in message and "theta_global was not changed" in message
