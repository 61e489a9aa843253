"""bucket_cap_mb="auto": caps from measured all-reduce cost, identical on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradsync.wrapper.bucket_caps as caps_module
from gradsync import DistributedDataParallel as DDP
from gradsync.engine.buckets import MIB
from gradsync.hooks import AllReduceState, PowerSGDState, allreduce_hook, powersgd_hook
from gradsync.wrapper.bucket_caps import ADAPT_MIN_BYTES, MIN_CAP, choose_cap, default_bucket_caps, default_caps_from

from harness import run_distributed
from models import assert_grads_close, global_batch, grads_of, loss_fn, make_model, rank_world, reference_step, shard


def test_choose_cap_balances_latency_against_transfer_time() -> None:
    # 50 us latency at 1 GB/s: latency is 10% of the transfer time of 500 KB
    assert choose_cap(50e-6, 1e9, total_bytes=100 * MIB) == 500_000
    # never above 25 MiB, however slow the start-up
    assert choose_cap(1.0, 1e9, total_bytes=10**12) == 25 * MIB
    # never below the floor, however fast
    assert choose_cap(1e-9, 1e9, total_bytes=100 * MIB) == MIN_CAP
    # at least four buckets for a model that is big enough
    assert choose_cap(50e-6, 1e9, total_bytes=1_600_000) == 400_000
    # where communication does not hide behind compute, small buckets only add collectives
    assert choose_cap(50e-6, 1e9, total_bytes=1_600_000, overlap=0.2) == 25 * MIB
    assert choose_cap(50e-6, 1e9, total_bytes=1_600_000, overlap=0.9) == 400_000


def _auto() -> list[int]:
    rank, world = rank_world()
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb="auto", gradient_as_bucket_view=True)
    for step in range(2):
        x, y = global_batch("mlp", world, step)
        model.zero_grad()
        reference.zero_grad()
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        reference_step(reference, x, y, world)
        assert_grads_close(grads_of(model), grads_of(reference))
    with pytest.raises(ValueError, match="cannot be combined"):
        DDP(make_model("mlp"), bucket_cap_mb="auto", bucket_cap_mb_list=[1])
    return ddp.engine.layout.caps


def test_auto_caps_are_identical_on_every_rank_and_train_correctly() -> None:
    caps = run_distributed(_auto, 3)
    assert caps[0] == caps[1] == caps[2] and len(caps[0]) == 1 and caps[0][0] >= MIN_CAP


def test_default_caps_are_torch_s_unless_communication_overlaps() -> None:
    """[Note: the default caps]: torch's 1 MiB + 25 MiB unless the collective waits on a link."""
    torch_caps = [1 * MIB, 25 * MIB]
    assert default_caps_from(total_bytes=100 * MIB, cpu_share=0.9) == torch_caps  # loopback: gloo computes
    assert default_caps_from(total_bytes=16 * MIB, cpu_share=0.05) == [2 * MIB]  # waits on a link: 8 buckets
    assert default_caps_from(total_bytes=1000 * MIB, cpu_share=0.05) == [25 * MIB]  # never above torch's cap
    assert default_caps_from(total_bytes=4 * MIB, cpu_share=0.05) == [MIB // 2]
    assert default_caps_from(total_bytes=MIB, cpu_share=0.05) == [MIN_CAP]  # never below 256 KiB
    # a small model is not probed at all: no collective (none could run here, without a process group)
    assert default_bucket_caps(None, None, ADAPT_MIN_BYTES - 1) == torch_caps


def _buckets_after_rebuild(
    hook: str | None,
    user_cap_mb: float | None,
    static_later: bool = False,
    width: int = 256,
    link: str = "1gbit",
    options: dict[str, object] | None = None,
) -> int:
    """Buckets after iteration 1's rebuild, with the default's caps as ``link`` makes them: a slow link
    cuts them small, loopback keeps torch's (1 MiB first)."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, width), nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, 4))
    verdict = [MIN_CAP] if link == "1gbit" else [MIB, 25 * MIB]
    original = caps_module.default_bucket_caps
    caps_module.default_bucket_caps = lambda group, device, total: verdict
    try:
        kwargs = dict(options or {}) if user_cap_mb is None else {**(options or {}), "bucket_cap_mb": user_cap_mb}
        ddp = DDP(model, **kwargs)
    finally:
        caps_module.default_bucket_caps = original
    if hook == "powersgd":
        ddp.register_comm_hook(PowerSGDState(None, start_iter=2), powersgd_hook)
    elif hook == "allreduce":
        ddp.register_comm_hook(AllReduceState(None), allreduce_hook)
    if static_later:  # a new engine, the hook carried over: the caps must follow it too
        ddp._set_static_graph()
    for step in range(3):
        x, y = global_batch("mlp", world, step)
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    return len(ddp.engine.buckets.storages)


def test_a_compressing_hook_gets_one_bucket_under_the_link_default() -> None:
    """[Note: caps under a compressing hook]: PowerSGD sends little, small buckets only add latency."""
    assert run_distributed(_buckets_after_rebuild, 2, "powersgd", None) == [1, 1]  # 540 KiB
    # 2.1 MiB: torch's caps would cut it in two (1 MiB first), the link's in three (its 1 MiB layers); one here.
    assert run_distributed(_buckets_after_rebuild, 2, "powersgd", None, False, 512) == [1, 1]
    assert min(run_distributed(_buckets_after_rebuild, 2, "allreduce", None, False, 512)) >= 3
    assert min(run_distributed(_buckets_after_rebuild, 2, "allreduce", None)) >= 3  # the link's 256 KiB caps
    assert min(run_distributed(_buckets_after_rebuild, 2, "powersgd", 0.25)) >= 3  # caps the user chose stay
    assert run_distributed(_buckets_after_rebuild, 2, "powersgd", None, True) == [1, 1]  # _set_static_graph after


def test_a_compressing_hook_gets_one_bucket_under_torch_s_default_caps_on_a_cpu() -> None:
    """[Note: caps under a compressing hook]: on loopback (torch's caps) PowerSGD's second bucket is a
    second round of products and all-reduces that cannot overlap backward on a CPU: one bucket."""
    # 2.1 MiB: torch's caps cut it in two (1 MiB first)
    assert run_distributed(_buckets_after_rebuild, 2, "powersgd", None, False, 512, "loopback") == [1, 1]
    assert run_distributed(_buckets_after_rebuild, 2, "allreduce", None, False, 512, "loopback") == [2, 2]
    assert run_distributed(_buckets_after_rebuild, 2, None, None, False, 512, "loopback") == [2, 2]  # no hook
    # without the construction's agreement the default is torch's, unprobed: one bucket all the same
    unsynced = {"init_sync": False}
    assert run_distributed(_buckets_after_rebuild, 2, "powersgd", None, False, 512, "loopback", unsynced) == [1, 1]
    # caps the user chose stay
    assert min(run_distributed(_buckets_after_rebuild, 2, "powersgd", 1.0, False, 512, "loopback")) >= 2
    torch_layout = {"bucket_cap_mb_list": [1, 25]}
    assert run_distributed(_buckets_after_rebuild, 2, "powersgd", None, False, 512, "loopback", torch_layout) == [2, 2]
