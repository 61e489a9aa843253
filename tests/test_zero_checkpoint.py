"""``gradsync.zero.save_sharded`` / ``load_sharded``: a sharded checkpoint reloaded at other world sizes.

A chain 2 -> 4 -> 1 -> 3 ranks: each link loads the previous link's checkpoint, trains on, and saves.
The reference of each link is the uninterrupted run at its size from the same state: gradsync DDP +
an unsharded ``torch.optim.AdamW`` loaded with the plain ``state_dict()`` saved beside the
checkpoint, on the same batches (tests/test_zero.py holds that pair to the sharded optimizer).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from gradsync import DistributedDataParallel as DDP
from gradsync.zero import ShardedOptimizer, load_sharded, save_sharded

from harness import run_distributed
from models import MLP, all_gather_flat, global_batch, loss_fn, rank_world, shard

STEPS = 3  # per link
LR, WEIGHT_DECAY = 1e-2, 0.05
TIMEOUT_S = 120  # per call; the first call to a new pool also waits for its processes to start


def _groups(model: nn.Module) -> list[dict]:
    """Two param groups with different lr and weight decay: the shards straddle them."""
    head = [p for n, p in model.named_parameters() if n.startswith("head")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("head")]
    return [{"params": rest}, {"params": head, "lr": LR / 2, "weight_decay": 0.0}]


def _build(stage: int, depth: int = 4, seed: int = 0) -> tuple[DDP, ShardedOptimizer, DDP, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = MLP(depth=depth)
    reference_model = copy.deepcopy(model)
    ddp, reference = DDP(model, bucket_cap_mb=0.001), DDP(reference_model, bucket_cap_mb=0.001)
    sharded = ShardedOptimizer(ddp, torch.optim.AdamW, _groups(model), stage=stage, lr=LR, weight_decay=WEIGHT_DECAY)
    plain = torch.optim.AdamW(_groups(reference_model), lr=LR, weight_decay=WEIGHT_DECAY)
    return ddp, sharded, reference, plain


def _train(ddp: DDP, optimizer: torch.optim.Optimizer, scheduler: object, first: int) -> None:
    rank, world = rank_world()
    for step in range(first, first + STEPS):
        x, y = global_batch("mlp", world, step)
        optimizer.zero_grad()
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        optimizer.step()
        scheduler.step()


def _same_state(ours: dict, theirs: dict) -> bool:
    """Bitwise: the same param groups, keys, tensors."""
    if ours["param_groups"] != theirs["param_groups"] or ours["state"].keys() != theirs["state"].keys():
        return False
    for index, values in theirs["state"].items():
        if values.keys() != ours["state"][index].keys():
            return False
        if not all(torch.equal(ours["state"][index][k], v) for k, v in values.items()):
            return False
    return True


def _max_relative_difference(a: nn.Module, b: nn.Module) -> float:
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters()):
        worst = max(worst, ((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item())
    return worst


def _link(stage: int, load_from: str | None, save_to: str, first: int) -> dict:
    """Load ``load_from`` (if any), train ``STEPS`` steps from batch ``first``, save to ``save_to``."""
    rank, world = rank_world()
    ddp, sharded, reference, plain = _build(stage)
    result: dict = {}
    if load_from is not None:
        extra = load_sharded(load_from, ddp, sharded)
        saved = torch.load(os.path.join(load_from, "plain.pt"), weights_only=False)
        reference.module.load_state_dict(saved["model"])
        plain.load_state_dict(saved["optim"])
        result["state_as_saved"] = _same_state(sharded.state_dict(), saved["optim"])
        result["model_as_saved"] = all(torch.equal(v, saved["model"][k]) for k, v in ddp.module.state_dict().items())
        result["extra"] = extra["first"]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (sharded, plain)]
    if load_from is not None:
        schedulers[0].load_state_dict(extra["scheduler"])
        schedulers[1].load_state_dict(saved["scheduler"])
    _train(ddp, sharded, schedulers[0], first)
    _train(reference, plain, schedulers[1], first)
    result["difference"] = _max_relative_difference(ddp.module, reference.module)
    replicas = all_gather_flat(list(ddp.module.parameters()))
    result["identical"] = all(torch.equal(replicas[0], r) for r in replicas)
    save_sharded(save_to, ddp, sharded, extra={"scheduler": schedulers[0].state_dict(), "first": first + STEPS})
    plain_state = sharded.state_dict()  # collective: every rank
    if rank == 0:
        plain_file = {"model": ddp.module.state_dict(), "optim": plain_state, "scheduler": schedulers[0].state_dict()}
        torch.save(plain_file, os.path.join(save_to, "plain.pt"))
    names = sharded._engine.names
    state = sharded._piece_state()
    result["own_chunks"] = [
        f"optim.state.{names[p.param]}.{key}.{p.param_start}-{p.param_start + p.length}"
        for p in sharded._pieces
        for key, value in state.get(p, {}).items()
        if value.dim() == 1
    ]
    dist.barrier()
    return result


def _check_files(directory: str, results: list[dict]) -> None:
    """Each rank's chunks are in that rank's file; nothing is written twice (the model once)."""
    metadata = dcp.FileSystemReader(directory).read_metadata()
    where = {index.fqn: info for index, info in metadata.storage_data.items()}
    for rank, result in enumerate(results):
        assert result["own_chunks"], f"rank {rank} saved no optimizer state"
        for key in result["own_chunks"]:
            assert where[key].relative_path.startswith(f"__{rank}_"), (key, where[key].relative_path)
    written = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".distcp"))
    assert written == sum(info.length for info in where.values())
    assert len(where) == len(metadata.state_dict_metadata)


def _chain(stage: int, tmp_path: object) -> None:
    load_from, first = None, 0
    for link, world in enumerate((2, 4, 1, 3)):
        save_to = str(tmp_path / f"link{link}-world{world}")
        results = run_distributed(_link, world, stage, load_from, save_to, first, timeout_s=TIMEOUT_S)
        for rank, result in enumerate(results):
            where = f"world {world}, rank {rank}"
            assert result["identical"], f"{where}: replicas differ"
            assert result["difference"] <= 1e-6, f"{where}: {result['difference']:.3g} from the uninterrupted run"
            if load_from is not None:
                assert result["state_as_saved"], f"{where}: the loaded optimizer's state_dict() is not what was saved"
                assert result["model_as_saved"] and result["extra"] == first, where
        _check_files(save_to, results)
        load_from, first = save_to, first + STEPS


def test_a_sharded_checkpoint_reloads_at_2_4_1_3_ranks_and_trains_on(tmp_path: object) -> None:
    _chain(2, tmp_path)


def test_stage_1_too(tmp_path: object) -> None:
    _chain(1, tmp_path)


def _save_without(path: str, drop_split_piece: bool) -> bool:
    """Save after two steps; rank 1 leaves out its piece of a parameter it shares with rank 0."""
    rank, _ = rank_world()
    ddp, sharded, _, _ = _build(2)
    scheduler = torch.optim.lr_scheduler.StepLR(sharded, step_size=2)
    _train(ddp, sharded, scheduler, 0)
    found = True
    if drop_split_piece and rank == 1:
        shared = [p for p in sharded._pieces if p.param_start > 0]  # its first elements are on rank 0
        found = bool(shared)
        original = sharded._piece_state
        sharded._piece_state = lambda: {p: v for p, v in original().items() if p != shared[0]}
    save_sharded(path, ddp, sharded)
    return found


def _load_into(path: str, depth: int, head_only: bool = False) -> str:
    ddp, sharded, _, _ = _build(2, depth=depth)
    if head_only:  # the same model, an optimizer over part of it
        ddp = DDP(MLP(depth=depth))
        head = [p for n, p in ddp.module.named_parameters() if n.startswith("head")]
        sharded = ShardedOptimizer(ddp, torch.optim.AdamW, head, lr=LR)
    with pytest.raises(ValueError) as error:
        load_sharded(path, ddp, sharded)
    dist.barrier()
    return str(error.value)


def test_a_checkpoint_missing_a_parameter_or_part_of_its_state_names_it(tmp_path: object) -> None:
    shallow = str(tmp_path / "shallow")
    run_distributed(_save_without, 2, shallow, False, timeout_s=TIMEOUT_S)
    for message in run_distributed(_load_into, 3, shallow, 5, timeout_s=TIMEOUT_S):
        assert "missing from it: ['layers.4.0.weight', 'layers.4.0.bias']" in message, message
    for message in run_distributed(_load_into, 2, shallow, 4, True, timeout_s=TIMEOUT_S):
        assert "parameters ['layers.0.0.bias', 'layers.0.0.weight'," in message, message
    torn = str(tmp_path / "torn")
    assert all(run_distributed(_save_without, 2, torn, True, timeout_s=TIMEOUT_S))
    for message in run_distributed(_load_into, 3, torn, 4, timeout_s=TIMEOUT_S):
        assert "does not cover the optimizer state" in message and "elements" in message, message
