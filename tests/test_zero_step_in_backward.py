"""``ShardedOptimizer(step_in_backward=True)``: each bucket's shard stepped as it drains in backward.

Against gradsync DDP with the same unsharded torch optimizer in the same processes (which
tests/test_parity.py holds to single-process training); what the option refuses is named.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gradsync.engine.reduce_scatter as reduce_scatter
import gradsync.zero.param_buffers as param_buffers
from gradsync import DistributedDataParallel as DDP
from gradsync.zero import ShardedOptimizer

from harness import run_distributed
from models import global_batch, loss_fn, make_model, rank_world, shard
from zero_support import identical_across_ranks, max_relative_difference, sharded_and_reference, train

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.05})


def _parity(name: str, micro: int, overlap: bool, ddp_options: dict) -> dict:
    ddp, sharded, reference, plain = sharded_and_reference(
        name, 2, *ADAMW, 0.001, ddp_options, step_in_backward=True, overlap_param_gather=overlap
    )
    train(ddp, sharded, name, 5, micro)
    train(reference, plain, name, 5, micro)
    sharded.wait_for_params()
    return {
        "difference": max_relative_difference(ddp.module, reference.module),
        "identical": identical_across_ranks(ddp.module),
        "rebuilt": ddp.engine.rebuilt,
        "buckets": len(ddp.engine.buckets.storages),
    }


@pytest.mark.parametrize(
    "world,micro,overlap,ddp_options",
    [
        (2, 1, False, {}),
        (3, 1, True, {}),
        (2, 3, True, {}),  # no_sync: the synced backward steps, the others accumulate
        (2, 1, False, {"static_graph": True}),  # stepped at the end of backward
        (2, 2, False, {"find_unused_parameters": True}),  # tests/test_zero.py: with parameters unused
    ],
)
def test_matches_ddp_with_torch_adamw(world: int, micro: int, overlap: bool, ddp_options: dict) -> None:
    """Two param groups, an LR scheduler, the bucket rebuild after iteration 1 (state follows)."""
    for rank, result in enumerate(run_distributed(_parity, world, "mlp", micro, overlap, ddp_options)):
        rebuilds = not ddp_options.get("find_unused_parameters")
        assert result["rebuilt"] == rebuilds and result["buckets"] > 2, result
        assert result["identical"], f"replicas differ on rank {rank}"
        assert result["difference"] <= 1e-6, f"rank {rank}: {result['difference']:.3g} from DDP + torch AdamW"


def _collective_order() -> dict:
    """The collectives one backward issues, in order, and whether the parameters moved inside it."""
    ddp, sharded, _, _ = sharded_and_reference("mlp", 2, *ADAMW, 0.001, step_in_backward=True)
    train(ddp, sharded, "mlp", 2)  # past the rebuild
    issued: list[str] = []
    original_rs, original_ag = reduce_scatter.start_reduce_scatter, param_buffers.start_all_gather

    def rs(*args: object, **kwargs: object) -> object:
        issued.append(f"rs in {ddp.engine.phase}")
        return original_rs(*args, **kwargs)

    def ag(*args: object, **kwargs: object) -> object:
        issued.append(f"ag in {ddp.engine.phase}" if ddp.engine.reducing else "ag after backward")
        return original_ag(*args, **kwargs)

    reduce_scatter.start_reduce_scatter, param_buffers.start_all_gather = rs, ag
    try:
        rank, world = rank_world()
        x, y = global_batch("mlp", world, 99)
        before = [p.detach().clone() for p in ddp.module.parameters()]
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        sharded.wait_for_params()  # the last gathers may still be on the wire when backward returns
        moved = sum(not torch.equal(p, q) for p, q in zip(ddp.module.parameters(), before))
        sharded.step()
    finally:
        reduce_scatter.start_reduce_scatter, param_buffers.start_all_gather = original_rs, original_ag
    return {"issued": issued, "moved": moved, "params": len(before), "buckets": len(ddp.engine.buckets.storages)}


def test_each_bucket_is_gathered_inside_backward_once_its_reduce_scatter_drained() -> None:
    for result in run_distributed(_collective_order, 2):
        buckets, issued = result["buckets"], result["issued"]
        assert buckets > 2 and issued.count("rs in backward") == buckets, result
        gathers = [i for i in issued if i.startswith("ag")]
        assert len(gathers) == buckets and all(g.startswith("ag in ") for g in gathers), issued  # none in step()
        sent = [issued[: k + 1].count("rs in backward") for k, i in enumerate(issued) if i.startswith("ag")]
        assert all(s > k for k, s in enumerate(sent)), issued  # bucket k gathered after its reduce-scatter
        last_rs = len(issued) - 1 - issued[::-1].index("rs in backward")
        assert issued.index("ag in backward") < last_rs, issued  # one while backward still computes
        assert result["moved"] == result["params"], result  # every parameter stepped before step()


def _misuse() -> list[str]:
    rank, world = rank_world()
    x, y = global_batch("mlp", world, 0)
    messages = []
    with pytest.raises(ValueError, match="step_in_backward=True needs stage=2") as error:
        ShardedOptimizer(DDP(make_model("mlp")), torch.optim.SGD, stage=1, step_in_backward=True, lr=0.1)
    messages.append(str(error.value))

    def backward(ddp: DDP) -> None:
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()

    ddp = DDP(make_model("mlp"))
    optimizer = ShardedOptimizer(ddp, torch.optim.SGD, step_in_backward=True, lr=0.1)
    backward(ddp)
    with pytest.raises(RuntimeError, match="cannot clip") as error:
        optimizer.clip_grad_norm_(1.0)
    messages.append(str(error.value))
    optimizer.param_groups[0]["lr"] = 0.05  # set after the backward that stepped with 0.1
    with pytest.raises(RuntimeError, match="'lr' changed from 0.1 to 0.05 between backward and step") as error:
        optimizer.step()
    messages.append(str(error.value))
    backward(ddp)
    with pytest.raises(RuntimeError, match="optimizer.step\\(\\) was not called before this forward") as error:
        backward(ddp)  # its step() forgotten
    messages.append(str(error.value))

    ddp = DDP(make_model("mlp"))
    optimizer = ShardedOptimizer(ddp, torch.optim.SGD, step_in_backward=True, lr=0.1)
    ddp.rebuild_engine(dist.group.WORLD, keep_local_grads=True, caps=(25 * 2**20,))  # as gradsync.elastic does
    with pytest.raises(NotImplementedError, match="cannot run under gradsync.elastic") as error:
        optimizer.follow_engine()
    messages.append(str(error.value))
    return messages


def test_what_it_cannot_do_is_named() -> None:
    for rank, messages in enumerate(run_distributed(_misuse, 2)):
        assert all(f"rank {rank}" in message for message in messages), messages
        assert all("step_in_backward=False" in message for message in messages[1:]), messages
