"""A sharded optimizer under ``join`` (uneven inputs) against DDP + torch's optimizer under ``join``.

With plain DDP the rank that trains longest holds the truth: its optimizer stepped every step,
and the join's post hook hands its model to the others. With a sharded optimizer the ranks that
ran out of data must still step their shards, so after the join every rank's parameters and the
gathered optimizer state must equal that rank's, with the LR schedule it followed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join

from gradsync import DistributedDataParallel as DDP
from gradsync.zero import ShardedOptimizer

from harness import run_distributed
from models import UnusedBranch, global_batch, loss_fn, make_model, rank_world
from zero_support import identical_across_ranks, max_relative_difference, two_groups

BATCHES = {2: [5, 3], 3: [4, 6, 2]}  # per rank: uneven, and the longest is not always rank 0


def _uneven_loop(ddp: DDP, optimizer: torch.optim.Optimizer, batches: int, micro: int, name: str) -> None:
    """With the UnusedBranch model, its "sometimes" layer is used by the longest-training rank only, in odd
    steps: after the others joined, only the used map tells them it has a gradient."""
    rank, world = rank_world()
    longest = max(range(world), key=lambda r: BATCHES[world][r])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step in range(batches):
        optimizer.zero_grad()
        kw = {"use_sometimes": step % 2 == 1 and rank == longest} if name == "unused" else {}
        for m in range(micro):
            x, y = global_batch("mlp" if name == "unused" else name, 1, 100 * rank + 10 * step + m)
            if m < micro - 1:
                with ddp.no_sync():
                    loss_fn(ddp(x, **kw), y).backward()
            else:
                loss_fn(ddp(x, **kw), y).backward()
        optimizer.step()
        scheduler.step()


def _longest_rank_state(optimizer: torch.optim.Optimizer, longest: int) -> dict:
    state = [optimizer.state_dict() if dist.get_rank() == longest else None]
    dist.broadcast_object_list(state, src=longest)
    return state[0]


def _state_difference(actual: dict, expected: dict) -> float:
    assert actual["state"].keys() == expected["state"].keys()
    worst = 0.0
    for index, values in expected["state"].items():
        for key, value in values.items():
            got = actual["state"][index][key]
            if key == "step":
                assert float(got) == float(value), (index, got, value)
                continue
            worst = max(worst, ((got - value).abs().max() / value.abs().max().clamp_min(1e-12)).item())
    return worst


def _joined(stage: int, micro: int, torch_join: bool, name: str = "mlp", in_backward: bool = False) -> dict:
    rank, world = rank_world()
    batches = BATCHES[world]
    longest = max(range(world), key=lambda r: batches[r])
    torch.manual_seed(0)
    model = UnusedBranch() if name == "unused" else make_model(name)
    reference_model = copy.deepcopy(model)
    find_unused = name == "unused"
    ddp = DDP(model, bucket_cap_mb=0.001, find_unused_parameters=find_unused)
    reference = DDP(reference_model, bucket_cap_mb=0.001, find_unused_parameters=find_unused)
    kwargs = {"lr": 1e-2, "weight_decay": 0.05}
    groups = two_groups(model, kwargs["lr"])
    sharded = ShardedOptimizer(ddp, torch.optim.AdamW, groups, stage=stage, step_in_backward=in_backward, **kwargs)
    plain = torch.optim.AdamW(two_groups(reference_model, kwargs["lr"]), **kwargs)
    with Join([ddp, sharded]) if torch_join else ddp.join():
        _uneven_loop(ddp, sharded, batches[rank], micro, name)
    with reference.join():
        _uneven_loop(reference, plain, batches[rank], micro, name)
    state = sharded.state_dict()
    return {
        "difference": max_relative_difference(ddp.module, reference.module),
        "identical": identical_across_ranks(ddp.module),
        "state_difference": _state_difference(state, _longest_rank_state(plain, longest)),
    }


@pytest.mark.parametrize(
    "stage,world,micro,torch_join",
    [(2, 2, 1, False), (1, 2, 1, True), (2, 3, 1, True), (1, 3, 2, False), (2, 2, 3, True)],
)
def test_ranks_out_of_data_keep_stepping_their_shards(stage: int, world: int, micro: int, torch_join: bool) -> None:
    for rank, result in enumerate(run_distributed(_joined, world, stage, micro, torch_join)):
        assert result["identical"], f"replicas differ on rank {rank}"
        assert result["difference"] <= 1e-6, f"rank {rank}: {result['difference']:.3g} from DDP + AdamW under join"
        assert result["state_difference"] <= 1e-6, f"rank {rank}: optimizer state off by {result['state_difference']}"


def test_step_in_backward_steps_in_step_under_join() -> None:
    """Under join the step waits for step() (a joined rank shadows it there): same results as without."""
    for rank, result in enumerate(run_distributed(_joined, 3, 2, 1, True, "mlp", True)):
        assert result["identical"] and result["difference"] <= 1e-6, (rank, result)
        assert result["state_difference"] <= 1e-6, (rank, result)


@pytest.mark.parametrize("stage", [1, 2])
def test_join_with_unused_parameters(stage: int) -> None:
    """find_unused_parameters: a joined rank learns the used map and skips what DDP leaves without .grad."""
    for rank, result in enumerate(run_distributed(_joined, 2, stage, 1, False, "unused")):
        assert result["identical"] and result["difference"] <= 1e-6, (rank, result)
        assert result["state_difference"] <= 1e-6, (rank, result)


def _misordered() -> list[str]:
    torch.manual_seed(0)
    ddp = DDP(make_model("mlp"))
    optimizer = ShardedOptimizer(ddp, torch.optim.SGD, lr=0.1)
    x, y = global_batch("mlp", 1, 0)
    messages = []
    with pytest.raises(RuntimeError) as error:
        with Join([optimizer, ddp]):
            loss_fn(ddp(x), y).backward()
            optimizer.step()
    messages.append(str(error.value))
    with ddp.join():
        optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()
        with pytest.raises(NotImplementedError) as error:
            optimizer.clip_grad_norm_(1.0)
        messages.append(str(error.value))
        optimizer.step()
    return messages


def test_a_misordered_join_and_clipping_inside_one_are_named() -> None:
    order, clip = run_distributed(_misordered, 2)[0]
    assert "must come first. Use Join([ddp, optimizer])" in order
    assert "clip_grad_norm_ cannot be combined with join" in clip
