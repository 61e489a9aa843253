"""gradsync's DDP *is a* torch DDP: the type, every name torch's class defines, and the private
surface frameworks call (Lightning, Accelerate), each checked against torch's DDP or a hand reference."""

from __future__ import annotations

import copy
import gc
import inspect

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync import DistributedDataParallel as DDP

from harness import run_distributed
from models import MLP, UnusedBranch, global_batch, grads_of, loss_fn, rank_world, reference_step, shard

# Data attributes of torch's class, not behaviour: nothing to override.
_DATA = {"__module__", "__doc__", "__annotations__", "__dict__", "__weakref__", "_active_ddp_module"}


def test_subclass_of_torch_ddp_for_the_type() -> None:
    assert issubclass(DDP, TorchDDP)
    assert issubclass(DDP, torch.distributed.algorithms.join.Joinable)


def test_every_name_torch_defines_is_gradsync_s_own() -> None:
    """No method or property of torch's class can run on gradsync's state by inheritance."""
    ours = {name for cls in DDP.__mro__[: DDP.__mro__.index(TorchDDP)] for name in vars(cls)}
    inherited = sorted(name for name in vars(TorchDDP) if name not in _DATA and name not in ours)
    assert not inherited, f"torch's DistributedDataParallel members gradsync does not override: {inherited}"
    # And the resolution really lands on gradsync's code, never in torch/nn/parallel/distributed.py.
    for name in vars(TorchDDP):
        if name in _DATA or name.startswith("__abstract") or name == "_abc_impl":
            continue
        attr = inspect.getattr_static(DDP, name)
        func = getattr(attr, "fget", None) or getattr(attr, "__func__", None) or attr
        module = getattr(func, "__module__", "") or ""
        assert module.startswith("gradsync"), f"{name} resolves to {module}"


def test_every_torch_method_keeps_torch_s_parameters() -> None:
    """Code calls these names the way torch's class takes them: same parameters, or *args/**kwargs."""

    def parameters(cls: type, name: str) -> list[tuple[str, object, bool]] | None:
        attr = inspect.getattr_static(cls, name)
        func = getattr(attr, "__func__", attr)
        if not inspect.isfunction(func):
            return None
        return [
            (p.name, p.kind, p.default is inspect.Parameter.empty) for p in inspect.signature(func).parameters.values()
        ]

    differ = []
    for name in vars(TorchDDP):
        theirs, ours = parameters(TorchDDP, name), parameters(DDP, name)
        if theirs is None or ours is None:
            continue
        takes_anything = {kind for _, kind, _ in ours[1:]} == {
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        }
        if ours != theirs and not takes_anything:
            differ.append(name)
    assert not differ, f"gradsync's DistributedDataParallel takes other parameters than torch's for {differ}"


def test_internals_without_a_counterpart_say_so() -> None:
    with pytest.raises(NotImplementedError, match="_register_buffer_comm_hook is an internal of torch's"):
        DDP._register_buffer_comm_hook(object(), None, None)


# Keys torch's logger adds only later: runtime stats once sampled, rebuilt sizes at the 3rd forward,
# join, static graph, errors (TORCH_DDP_NOTES §1g, from logger.cpp).
_TORCH_KEYS_LATER = {
    "avg_backward_comm_time", "avg_backward_compute_comm_overlap_time", "avg_backward_compute_time",
    "avg_forward_compute_time", "num_buckets_reduced", "unused_parameter_size", "rebuilt_bucket_sizes",
    "rebuilt_per_bucket_param_indices", "join_uneven_inputs", "static_graph", "can_set_static_graph",
    "has_rebuilt_buckets", "comm_hook", "has_error", "error",
}  # fmt: skip


def _private_surface() -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    ddp = DDP(model)
    twin = TorchDDP(copy.deepcopy(model))
    assert isinstance(ddp, TorchDDP)
    assert ddp._distributed_rank == rank
    assert list(DDP._get_data_parallel_params(model)) == list(model.parameters())
    ddp._check_default_group()
    ddp._set_ddp_sink_clone(False)
    with pytest.raises(ValueError, match="DDP runtime logging sample rate should be equal or greater than 1"):
        ddp._set_ddp_runtime_logging_sample_rate(0)
    x, y = global_batch("mlp", world, 0)
    for wrapper in (ddp, twin):
        loss_fn(wrapper(shard(x, rank, world)), shard(y, rank, world)).backward()
    reference_step(ref, x, y, world)
    ddp._check_reducer_finalized()
    # torch's Reducer._rebuild_buckets(): rebuilds once after the first iteration, then never again.
    rebuilt = [ddp.reducer._rebuild_buckets(), ddp.reducer._rebuild_buckets()]
    ours, theirs = ddp._get_ddp_logging_data(), twin._get_ddp_logging_data()
    same_keys = [
        "world_size", "rank", "module_name", "backend_name", "bucket_cap_bytes", "find_unused_parameters",
        "gradient_as_bucket_view", "num_parameter_tensors", "total_parameter_size_bytes", "dtypes",
        "broadcast_buffers", "has_sync_bn", "iteration", "is_multi_device_module",
    ]  # fmt: skip
    mismatched = {k: (ours.get(k), theirs.get(k)) for k in same_keys if ours.get(k) != theirs.get(k)}
    unknown = sorted(set(ours) - set(theirs) - _TORCH_KEYS_LATER)
    grads_match = all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(), ref.parameters()))
    return {"rebuilt": rebuilt, "mismatched": mismatched, "unknown": unknown, "grads": grads_match, "data": ours}


def test_private_surface_matches_torch() -> None:
    for result in run_distributed(_private_surface, 2):
        assert result["rebuilt"] == [True, False]
        assert result["mismatched"] == {}, "logging data disagrees with torch's"
        assert result["unknown"] == [], "logging data keys torch does not have"
        assert result["grads"]
        assert result["data"]["can_set_static_graph"] == 1


def _can_set_static_graph(changing: bool) -> int:
    rank, world = rank_world()
    torch.manual_seed(0)
    ddp = DDP(UnusedBranch(), find_unused_parameters=True)
    for i in range(4):
        x, y = global_batch("mlp", world, i)
        use_sometimes = changing and i % 2 == 1
        loss_fn(ddp(shard(x, rank, world), use_sometimes=use_sometimes), shard(y, rank, world)).backward()
    return ddp._get_ddp_logging_data()["can_set_static_graph"]


def test_can_set_static_graph_tells_whether_the_unused_set_changed() -> None:
    assert run_distributed(_can_set_static_graph, 2, False) == [1, 1]
    assert run_distributed(_can_set_static_graph, 2, True) == [0, 0]


class _ClearsSyncFlag(MLP):
    """Clears the wrapper's flag from inside its forward, as Lightning's manual optimization does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if "owner" in self.__dict__:
            self.__dict__["owner"].require_backward_grad_sync = False
        return out


def _arm_by_hand(find_unused: bool, lightning_style: bool) -> dict:
    """Accelerate's trigger_sync_in_backward and Lightning's manual optimization: the forward does not
    arm the reducer, the framework calls reducer.prepare_for_backward itself. Compared with torch's DDP
    doing the same, or with the single-process reference where torch's DDP raises "marked as ready
    twice": Accelerate's sequence with find_unused_parameters=True (torch takes "no outputs" for "no
    parameter used"), and this bare Lightning sequence (tests/test_integration_lightning.py runs the
    real one against torch's DDP)."""
    rank, world = rank_world()
    results = {}
    torch_fails = lightning_style or find_unused
    others = (("reference", None),) if torch_fails else (("torch", TorchDDP),)
    for name, wrapper in (("gradsync", DDP), *others):
        torch.manual_seed(0)
        model = _ClearsSyncFlag() if lightning_style else MLP()
        if wrapper is None:
            grads = []
            for i in range(3):
                x, y = global_batch("mlp", world, i)
                reference_step(model, x, y, world)
                grads.append(grads_of(model))
                model.zero_grad(set_to_none=True)
            results[name] = grads
            continue
        ddp = wrapper(model, find_unused_parameters=find_unused)
        model.__dict__["owner"] = ddp
        grads = []
        for i in range(3):
            x, y = global_batch("mlp", world, i)
            if lightning_style:
                loss = loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world))
                ddp.require_backward_grad_sync = True
                ddp.reducer._rebuild_buckets()
                ddp.reducer.prepare_for_backward([loss] if find_unused else [])
            else:
                with ddp.no_sync():
                    loss = loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world))
                ddp.reducer.prepare_for_backward([])
            loss.backward()
            grads.append(grads_of(model))
            for p in model.parameters():
                p.grad = None
        results[name] = grads
    ours, theirs = results["gradsync"], results[others[0][0]]
    same = all(torch.allclose(a[k], b[k], atol=1e-6) for a, b in zip(ours, theirs) for k in a)
    return {"same": same, "grads": ours[-1]}


@pytest.mark.parametrize("find_unused", [False, True])
@pytest.mark.parametrize("lightning_style", [False, True])
def test_reducer_prepare_for_backward_arms_an_unsynced_forward(find_unused: bool, lightning_style: bool) -> None:
    results = run_distributed(_arm_by_hand, 2, find_unused, lightning_style)
    assert all(r["same"] for r in results), "gradients differ from torch's DDP doing the same"
    # Averaged: both ranks hold the same gradient although each saw its own shard.
    assert all(torch.equal(results[0]["grads"][k], results[1]["grads"][k]) for k in results[0]["grads"])


def _delay_all_reduce_after_backward() -> bool:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    ddp = DDP(model, static_graph=True)
    x, y = global_batch("mlp", world, 0)
    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    ddp.reducer._delay_all_reduce()  # what Lightning's manual optimization calls after it
    reference_step(ref, x, y, world)
    return all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(), ref.parameters()))


def test_delay_all_reduce_after_the_first_static_backward_is_harmless() -> None:
    assert all(run_distributed(_delay_all_reduce_after_backward, 2))


def _builtin_hook_like_torch() -> bool:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    pairs = [(DDP(model), model), (TorchDDP(twin), twin)]
    for ddp, _ in pairs:
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    for i in range(2):
        x, y = global_batch("mlp", world, i)
        for ddp, module in pairs:
            module.zero_grad()
            loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    assert pairs[0][0]._get_ddp_logging_data()["comm_hook"] == "BuiltinCommHookType.FP16_COMPRESS"
    return all(torch.allclose(p.grad, q.grad, atol=1e-3) for p, q in zip(model.parameters(), twin.parameters()))


def test_builtin_fp16_hook_matches_torch() -> None:
    assert all(run_distributed(_builtin_hook_like_torch, 2))


def _hooks_of(model: torch.nn.Module) -> list[int]:
    return [len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()]


def _discarded_wrappers() -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    first = DDP(model)
    one = _hooks_of(model)
    second = DDP(model)  # Lightning's second fit: a new wrapper, the old one still referenced
    after_second = _hooks_of(model)
    with pytest.raises(RuntimeError, match="a newer DistributedDataParallel was built over the same parameters"):
        first(torch.zeros(1, 16))
    x, y = global_batch("mlp", world, 0)
    loss_fn(second(shard(x, rank, world)), shard(y, rank, world)).backward()
    reference_step(ref, x, y, world)
    grads_ok = all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(), ref.parameters()))
    del first, second
    gc.collect()
    after_collect = _hooks_of(model)
    third = DDP(model)
    del third  # dropped without gc.collect: the reference count alone must free it
    after_drop = _hooks_of(model)
    return {"one": one, "two": after_second, "grads": grads_ok, "collected": after_collect, "dropped": after_drop}


def test_a_discarded_or_replaced_wrapper_leaves_no_hooks() -> None:
    for result in run_distributed(_discarded_wrappers, 2):
        n = len(result["one"])
        assert result["one"] == [1] * n and result["two"] == [1] * n
        assert result["grads"]
        assert result["collected"] == [0] * n
        assert result["dropped"] == [0] * n


def _update_process_group() -> bool:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    ddp = DDP(model)
    ddp._update_process_group(dist.new_group(list(range(world))))
    x, y = global_batch("mlp", world, 0)
    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    reference_step(ref, x, y, world)
    return all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(), ref.parameters()))


def test_update_process_group_reduces_over_the_new_group() -> None:
    assert all(run_distributed(_update_process_group, 2))


def _compiled(backend: str) -> bool:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    compiled = torch.compile(DDP(model), backend=backend)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        x, y = global_batch("mlp", world, i)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss_fn(compiled(shard(x, rank, world)), shard(y, rank, world)).backward()
        reference_step(ref, x, y, world)
        opt.step()
        ref_opt.step()
    torch._dynamo.reset()
    return all(torch.allclose(p, q, atol=1e-5) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.timeout(240)
def test_torch_compile_of_the_whole_wrapper_trains_like_the_reference() -> None:
    """dynamo treats DDP instances specially; gradsync's synchronisation stays out of the graph."""
    assert all(run_distributed(_compiled, 2, "aot_eager", timeout_s=200))


def test_gradsync_exports() -> None:
    assert gradsync.DistributedDataParallel is DDP
