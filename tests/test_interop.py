"""gradsync next to the rest of PyTorch, each case checked against torch's DDP doing the same."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from gradsync import DistributedDataParallel as DDP

from harness import run_distributed
from models import MLP, CheckpointedTwice, global_batch, loss_fn, make_model, rank_world, shard

TorchDDP = torch.nn.parallel.DistributedDataParallel
_PICKLE_DEFAULT_GROUP_ONLY = "^DDP Pickling/Unpickling are only supported when using DDP with the default process group"


def _assert_same_params(ours: torch.nn.Module, theirs: torch.nn.Module, what: str, exact: bool = False) -> None:
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if exact:
            assert torch.equal(p, q), f"{what}: {name} differs"
        else:
            assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), f"{what}: {name} max diff {(p - q).abs().max()}"


def _side_by_side(
    make: Callable[[], torch.nn.Module],
    wrap_kwargs: dict,
    step: Callable[[Any, Any, int], None],
    steps: int = 4,
    make_opt: Callable[[torch.nn.Module], Any] | None = None,
    exact: bool = False,
    what: str = "",
) -> None:
    """Train the same model with gradsync and with torch DDP; parameters must agree."""
    model = make()
    twin = copy.deepcopy(model)
    pairs = []
    for wrapper, module in ((DDP, model), (TorchDDP, twin)):
        ddp = wrapper(module, **wrap_kwargs)
        opt = make_opt(module) if make_opt else torch.optim.SGD(module.parameters(), lr=0.1)
        pairs.append((ddp, opt))
    for i in range(steps):
        for ddp, opt in pairs:
            opt.zero_grad()
            step(ddp, opt, i)
        _assert_same_params(model, twin, f"{what} step {i}", exact)


def _plain_step(ddp: Any, opt: Any, i: int) -> None:
    rank, world = rank_world()
    x, y = global_batch("mlp", world, i)
    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.step()


def _zero() -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def make_opt(module: torch.nn.Module) -> Any:
        return ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)

    _side_by_side(MLP, {}, _plain_step, make_opt=make_opt, exact=True, what="ZeroRedundancyOptimizer")


def test_zero_redundancy_optimizer() -> None:
    run_distributed(_zero, 2)


def _autocast_bf16() -> None:
    def step(ddp: Any, opt: Any, i: int) -> None:
        rank, world = rank_world()
        x, y = global_batch("cnn_bn", world, i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ddp(shard(x, rank, world))
        loss_fn(out.float(), shard(y, rank, world)).backward()
        opt.step()

    _side_by_side(lambda: make_model("cnn_bn"), {}, step, exact=True, what="autocast bf16")


def test_autocast_bf16() -> None:
    run_distributed(_autocast_bf16, 2)


def _grad_scaler_fp16() -> None:
    scalers: dict[int, Any] = {}

    def step(ddp: Any, opt: Any, i: int) -> None:
        rank, world = rank_world()
        scaler = scalers.setdefault(id(opt), torch.amp.GradScaler("cpu", init_scale=2.0**8))
        x, y = global_batch("mlp", world, i)
        with torch.autocast("cpu", dtype=torch.float16):
            out = ddp(shard(x, rank, world))
        scaler.scale(loss_fn(out.float(), shard(y, rank, world))).backward()
        scaler.step(opt)
        scaler.update()

    _side_by_side(MLP, {}, step, exact=True, what="GradScaler fp16")


def test_grad_scaler_fp16() -> None:
    run_distributed(_grad_scaler_fp16, 2)


def _checkpointing(use_reentrant: bool) -> None:
    def step(ddp: Any, opt: Any, i: int) -> None:
        rank, world = rank_world()
        x, y = global_batch("mlp", world, i)
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return CheckpointedTwice(use_reentrant)

    kwargs = {"static_graph": True} if use_reentrant else {}
    _side_by_side(make, kwargs, step, exact=True, what=f"checkpoint use_reentrant={use_reentrant}")


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing(use_reentrant: bool) -> None:
    run_distributed(_checkpointing, 2, use_reentrant)


def _compiled_inner_module() -> None:
    rank, world = rank_world()
    torch.manual_seed(0)
    eager = MLP()
    compiled_source = copy.deepcopy(eager)
    ours = DDP(torch.compile(compiled_source))
    theirs = TorchDDP(eager)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (compiled_source, eager)]
    for i in range(3):
        x, y = global_batch("mlp", world, i)
        for ddp, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        _assert_same_params(compiled_source, eager, f"torch.compile step {i}")
    assert all(k.startswith("module._orig_mod.") for k in ours.state_dict())


def test_torch_compile_inner_module() -> None:
    run_distributed(_compiled_inner_module, 2, timeout_s=300)


class _Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randn(4, generator=g)


def _sampler_and_workers() -> None:
    from torch.utils.data import DataLoader, DistributedSampler

    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    pairs = [(DDP(model), model), (TorchDDP(twin), twin)]
    dataset = _Squares()
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for _, m in pairs]
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            for (ddp, _), opt in zip(pairs, opts):
                opt.zero_grad()
                loss_fn(ddp(x), y).backward()
                opt.step()
    _assert_same_params(model, twin, "DistributedSampler + DataLoader workers", exact=True)


def test_distributed_sampler_and_dataloader_workers() -> None:
    run_distributed(_sampler_and_workers, 2)


def _pickle_and_deepcopy() -> None:
    rank, world = rank_world()
    torch.manual_seed(0)
    ddp = DDP(MLP())
    for copied in (pickle.loads(pickle.dumps(ddp)), copy.deepcopy(ddp)):
        twin = TorchDDP(copy.deepcopy(copied.module))
        x, y = global_batch("mlp", world, 0)
        for wrapper in (copied, twin):
            loss_fn(wrapper(shard(x, rank, world)), shard(y, rank, world)).backward()
        for p, q in zip(copied.module.parameters(), twin.module.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert copied.module is not ddp.module
    subgroup = dist.new_group(list(range(world)))
    in_subgroup = DDP(MLP(), process_group=subgroup)
    with pytest.raises(RuntimeError, match=_PICKLE_DEFAULT_GROUP_ONLY):
        pickle.dumps(in_subgroup)
    with pytest.raises(RuntimeError, match=_PICKLE_DEFAULT_GROUP_ONLY):
        copy.deepcopy(in_subgroup)
    buffer = io.BytesIO()
    torch.save(ddp.module.state_dict(), buffer)  # the usual way to move a model is still fine


def test_pickle_and_deepcopy() -> None:
    run_distributed(_pickle_and_deepcopy, 2)


def _device_mesh() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    _side_by_side(MLP, {"device_mesh": mesh}, _plain_step, exact=True, what="device_mesh")
    with pytest.raises(RuntimeError, match="^Only 1D device mesh is supported"):
        DDP(MLP(), device_mesh=init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("a", "b")))


def test_device_mesh_means_its_process_group() -> None:
    run_distributed(_device_mesh, 2)
