"""SyncBatchNorm equals one BatchNorm over the concatenated global batch.

Every distributed check runs the same data through a ``SyncBatchNorm`` on each rank's
rows and through a plain ``nn.BatchNormNd`` on all rows in one process, and compares
outputs, input gradients, weight/bias gradients and running statistics.

Loss scaling, with W ranks and N rows in the global batch (see the Note in
``sync_batchnorm.py``):
- ``global_sum``: each rank's loss is ``sum(y * t) / N`` over its rows, so the losses add
  up to the reference loss; input gradients equal the reference's, and weight/bias
  gradients *summed* over ranks (DDP's average times W) equal the reference's. Works
  for uneven shards.
- ``local_mean``: each rank's loss is the mean over its own rows, as a training loop
  under DDP writes it; with even shards the reference is the mean over the global
  batch, input gradients are W times the reference's, and DDP's average of the
  weight/bias gradients equals the reference's.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync import DistributedDataParallel as DDP
from gradsync.sync_batchnorm import SyncBatchNorm

from harness import run_distributed
from models import assert_grads_close, global_batch, grads_of, loss_fn, make_model, rank_world, shard

CHANNELS = 3
# name -> (reference layer, trailing dims after (N, C))
SHAPES: dict[str, tuple[type[nn.Module], tuple[int, ...]]] = {
    "1d_flat": (nn.BatchNorm1d, ()),
    "1d_seq": (nn.BatchNorm1d, (5,)),
    "2d": (nn.BatchNorm2d, (4, 3)),
    "3d": (nn.BatchNorm3d, (3, 2, 2)),
}
# Rows per rank: even, uneven, and one rank with an empty shard.
SIZES = {
    2: {"even": [4, 4], "uneven": [2, 5], "empty": [0, 6]},
    3: {"even": [3, 3, 3], "uneven": [1, 4, 2], "empty": [3, 0, 4]},
}
OPTIONS: dict[str, dict] = {
    "default": {},
    "cumulative_average": {"momentum": None},
    "no_affine": {"affine": False},
    "no_running_stats": {"track_running_stats": False},
}
if "bias" in inspect.signature(nn.BatchNorm1d).parameters:  # torch versions with BatchNorm(bias=...)
    OPTIONS["no_bias"] = {"bias": False}
ATOL, RTOL = 1e-5, 1e-4


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    assert torch.allclose(actual, expected, atol=ATOL, rtol=RTOL), (
        f"{what}: max diff {(actual - expected).abs().max().item()}"
    )


def _make_pair(bn_cls: type[nn.Module], **options) -> tuple[SyncBatchNorm, nn.Module]:
    """A reference BatchNorm with non-trivial weights, and a SyncBatchNorm with the same state."""
    reference = bn_cls(CHANNELS, **options)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    sync = SyncBatchNorm(CHANNELS, **options)
    sync.load_state_dict(reference.state_dict())
    return sync, reference


def _batch(sizes: list[int], tail: tuple[int, ...], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (offset and scaled so the statistics are not trivial) and a target."""
    generator = torch.Generator().manual_seed(100 + step)
    shape = (sum(sizes), CHANNELS, *tail)
    x = 3.0 + 2.0 * torch.randn(shape, generator=generator)
    return x, torch.randn(shape, generator=generator)


def _rows(sizes: list[int], position: int) -> slice:
    start = sum(sizes[:position])
    return slice(start, start + sizes[position])


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _averaged(grad: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """What DDP leaves in ``.grad``: the average over the group's ranks."""
    grad = grad.clone()
    if dist.is_initialized():
        dist.all_reduce(grad, group=group)
    return grad / _group_size(group)


def _check_training_steps(
    sync: SyncBatchNorm,
    reference: nn.Module,
    tail: tuple[int, ...],
    sizes: list[int],
    position: int,
    group: dist.ProcessGroup | None,
    loss_mode: str,
    steps: int = 3,
) -> None:
    """Train-mode forward/backward for a few steps; everything matches the reference."""
    world = _group_size(group)
    rows, total = _rows(sizes, position), sum(sizes)
    input_scale, param_scale = (1, world) if loss_mode == "global_sum" else (world, 1)
    for step in range(steps):
        x, target = _batch(sizes, tail, step)
        x_ref, x_local = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
        sync.zero_grad()
        reference.zero_grad()
        y, y_ref = sync(x_local), reference(x_ref)
        _close(y, y_ref[rows], f"step {step} output")
        if loss_mode == "global_sum":
            ((y * target[rows]).sum() / total).backward()
            ((y_ref * target).sum() / total).backward()
        else:
            (y * target[rows]).mean().backward()
            (y_ref * target).mean().backward()
        _close(x_local.grad, input_scale * x_ref.grad[rows], f"step {step} input grad")
        for (name, p), p_ref in zip(sync.named_parameters(), reference.parameters()):
            _close(param_scale * _averaged(p.grad, group), p_ref.grad, f"step {step} {name}.grad")
        for (name, b), b_ref in zip(sync.named_buffers(), reference.buffers()):
            _close(b.double(), b_ref.double(), f"step {step} {name}")


def _check_eval(sync: SyncBatchNorm, reference: nn.Module, tail: tuple[int, ...], sizes: list[int], position: int):
    """Eval mode: running stats (or local batch stats without them), and no collective.

    Rank r calls forward r + 1 times: a collective in eval mode would hang or fail.
    """
    sync.eval()
    reference.eval()
    x, _ = _batch(sizes, tail, step=99)
    local = x[_rows(sizes, position)]
    for _ in range(position + 1):
        if local.shape[0] > 1 or sync.track_running_stats:
            _close(sync(local), reference(local), "eval output")


def _sweep_against_batchnorm(shape: str) -> int:
    rank, world = rank_world()
    bn_cls, tail = SHAPES[shape]
    checked = 0
    for sizes_name, sizes in SIZES[world].items():
        for options_name, options in OPTIONS.items():
            loss_modes = ["global_sum", "local_mean"] if sizes_name == "even" else ["global_sum"]
            for loss_mode in loss_modes:
                sync, reference = _make_pair(bn_cls, **options)
                try:
                    _check_training_steps(sync, reference, tail, sizes, rank, None, loss_mode)
                    _check_eval(sync, reference, tail, sizes, rank)
                except AssertionError as error:
                    raise AssertionError(f"{shape} sizes={sizes} {options_name} {loss_mode}: {error}") from error
                checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_batchnorm_over_global_batch(world_size: int, shape: str) -> None:
    counts = run_distributed(_sweep_against_batchnorm, world_size, shape)
    expected = len(OPTIONS) * (len(SIZES[world_size]) + 1)  # "even" runs both loss modes
    assert counts == [expected] * world_size


def _subgroups_sync_separately() -> None:
    """process_group scopes the statistics; a group of one is plain BatchNorm."""
    rank, world = rank_world()
    layout = [[0], [1]] if world == 2 else [[0, 1], [2]]
    groups = [dist.new_group(ranks) for ranks in layout]  # every rank creates every group
    mine = next(i for i, ranks in enumerate(layout) if rank in ranks)
    members = layout[mine]
    sizes = [2 + r for r in members]  # uneven within the group
    sync, reference = _make_pair(nn.BatchNorm2d, momentum=None)
    sync.process_group = groups[mine]
    _check_training_steps(sync, reference, (3, 3), sizes, members.index(rank), groups[mine], "global_sum")


@pytest.mark.parametrize("world_size", [2, 3])
def test_process_group_scopes_the_statistics(world_size: int) -> None:
    run_distributed(_subgroups_sync_separately, world_size)


def _one_value_in_global_batch() -> str:
    rank, _ = rank_world()
    layer = SyncBatchNorm(CHANNELS)
    try:
        layer(torch.randn(1 if rank == 0 else 0, CHANNELS))
    except ValueError as error:
        return str(error)
    return "no error"


def test_one_value_per_channel_globally_raises_on_every_rank() -> None:
    messages = run_distributed(_one_value_in_global_batch, 2)
    assert all("expected more than 1 value per channel" in m for m in messages), messages
    assert "SyncBatchNorm(num_features=3)" in messages[0]


def test_without_process_group_is_plain_batchnorm() -> None:
    """The pytest process never initialises torch.distributed."""
    assert not dist.is_initialized()
    for options in OPTIONS.values():
        sync, reference = _make_pair(nn.BatchNorm2d, **options)
        _check_training_steps(sync, reference, (4, 3), [6], 0, None, "local_mean")
        _check_eval(sync, reference, (4, 3), [6], 0)


@pytest.mark.parametrize(
    "shape, expected",
    [((CHANNELS,), "at least 2 dims"), ((4, CHANNELS + 2, 2), "with 5 channels in dim 1, expected 3")],
)
@pytest.mark.parametrize("training", [True, False])
def test_bad_input_shape_names_the_layer(shape: tuple[int, ...], expected: str, training: bool) -> None:
    layer = SyncBatchNorm(CHANNELS).train(training)
    with pytest.raises(ValueError, match="SyncBatchNorm\\(num_features=3\\)") as info:
        layer(torch.randn(shape))
    assert expected in str(info.value)


def _model_with_every_batchnorm() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.BatchNorm1d(4),
        nn.Sequential(nn.BatchNorm2d(4, affine=False), nn.BatchNorm3d(4, track_running_stats=False)),
        nn.SyncBatchNorm(4, momentum=None, eps=1e-3),
    )
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("num_batches_tracked"):
                tensor.fill_(7)
            elif tensor.is_floating_point():
                tensor.copy_(torch.rand_like(tensor) + 0.5)
    model[1].weight.requires_grad_(False)
    model[2][0].eval()
    return model


def test_convert_sync_batchnorm_shares_state_and_flags() -> None:
    model = _model_with_every_batchnorm()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    originals = {name: m for name, m in model.named_modules()}
    group = object()  # only stored; no collective runs here
    converted = SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    assert converted is model  # a container is converted in place
    for name, module in converted.named_modules():
        old = originals[name]
        if not isinstance(old, nn.modules.batchnorm._BatchNorm):
            assert module is old, f"{name} should be untouched"
            continue
        assert type(module) is SyncBatchNorm, f"{name} is still {type(module).__name__}"
        assert module.process_group is group and module.training == old.training
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            assert getattr(module, attr) == getattr(old, attr), f"{name}.{attr}"
        for attr in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            assert getattr(module, attr) is getattr(old, attr), f"{name}.{attr} is not shared"
    assert converted.state_dict().keys() == before.keys()
    for name, tensor in converted.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert not converted[1].weight.requires_grad and converted[1].bias.requires_grad
    assert not converted[2][0].training and converted[1].training


def test_convert_a_bare_batchnorm_returns_a_new_layer() -> None:
    bn = nn.BatchNorm2d(4, momentum=0.3).eval()
    converted = SyncBatchNorm.convert_sync_batchnorm(bn)
    assert isinstance(converted, SyncBatchNorm) and converted is not bn
    assert converted.weight is bn.weight and converted.momentum == 0.3 and not converted.training
    x = torch.randn(3, 4, 2, 2)
    assert torch.equal(converted(x), bn(x))


def test_convert_an_uninitialised_lazy_batchnorm_raises() -> None:
    with pytest.raises(ValueError, match="LazyBatchNorm2d has not inferred num_features"):
        SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))


def _ddp_trains_converted_cnn() -> None:
    """A converted ConvBN under DDP trains like ConvBN on the whole batch in one process."""
    rank, world = rank_world()
    model = make_model("cnn_bn")
    reference = copy.deepcopy(model)
    model = SyncBatchNorm.convert_sync_batchnorm(model)
    assert sum(isinstance(m, SyncBatchNorm) for m in model.modules()) == 2
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = global_batch("cnn_bn", world, step)
        opt.zero_grad()
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()  # mean over the local shard
        ref_opt.zero_grad()
        loss_fn(reference(x), y).backward()  # mean over the global batch
        assert_grads_close(grads_of(model), grads_of(reference))
        opt.step()
        ref_opt.step()
    for (name, tensor), ref in zip(model.state_dict().items(), reference.state_dict().values()):
        _close(tensor.double(), ref.double(), f"after 3 steps: {name}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_converted_model_under_ddp_matches_single_process(world_size: int) -> None:
    run_distributed(_ddp_trains_converted_cnn, world_size)
