"""Timeline, profiler labels, stats, divergence and desync detection, unused-parameter warning."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import gradsync
from gradsync import DistributedDataParallel as DDP

from harness import run_distributed
from models import MLP, UnusedBranch, global_batch, loss_fn, make_model, rank_world, reference_step, shard

# MLP(): 4 x Linear(16, 16) + Linear(16, 4): 4 x 272 + 68 = 1156 floats = 4624 bytes.
MLP_PARAM_BYTES = 4 * (16 * 16 + 16) * 4 + (16 * 4 + 4) * 4


def _train(ddp: DDP, steps: int, name: str = "mlp", **kwargs: object) -> None:
    rank, world = rank_world()
    for step in range(steps):
        x, y = global_batch(name, world, step)
        ddp.zero_grad()
        loss_fn(ddp(shard(x, rank, world), **kwargs), shard(y, rank, world)).backward()


def _trace(directory: str) -> None:
    # A cap of 1000 bytes; a hidden layer is 1024 + 64 bytes, the head 256 + 16. Each hidden
    # weight (1024) is above the cap and travels alone (buckets.py, lone_oversized); the head and
    # the four biases (528) share one bucket: 5 buckets per iteration.
    ddp = DDP(MLP(), bucket_cap_mb=1000 / 2**20)
    _train(ddp, 1)
    with gradsync.trace(ddp, os.path.join(directory, "trace.json"), png=os.path.join(directory, "overlap.png")):
        _train(ddp, 3)
    dist.barrier()


def _traced(job: Callable[[str], None]) -> tuple[list[dict], bytes | None]:
    """``job(directory)`` on 2 ranks: the events of the trace it wrote, and its PNG's first bytes (if any)."""
    with tempfile.TemporaryDirectory() as directory:
        run_distributed(job, 2, directory)
        with open(os.path.join(directory, "trace.json")) as f:
            events = json.load(f)["traceEvents"]
        png = os.path.join(directory, "overlap.png")
        if not os.path.exists(png):
            return events, None
        with open(png, "rb") as f:
            return events, f.read(8)


def test_trace_writes_merged_perfetto_json_and_png() -> None:
    events, png = _traced(_trace)
    assert png == b"\x89PNG\r\n\x1a\n"
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {"rank 0", "rank 1"}
    for rank in (0, 1):
        threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == rank}
        assert set(threads.values()) == {"step"} | {f"bucket {b}" for b in range(5)}
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
        for iteration in (1, 2, 3):
            mine = [e for e in spans if e["args"]["iteration"] == iteration]
            phase = {e["name"]: e for e in mine if threads[e["tid"]] == "step"}
            assert phase["forward"]["ts"] + phase["forward"]["dur"] <= phase["backward_compute"]["ts"]
            reduces = sorted((e for e in mine if e["name"] == "all_reduce"), key=lambda e: threads[e["tid"]])
            assert len(reduces) == 5
            starts = [e["ts"] for e in reduces]
            assert starts == sorted(starts), "buckets must launch in index order"
            assert sum(e["args"]["bytes"] for e in reduces) == MLP_PARAM_BYTES
            assert starts[0] >= phase["backward_compute"]["ts"]


def _trace_across_rebuild(directory: str) -> None:
    ddp = DDP(MLP())
    with gradsync.trace(ddp, os.path.join(directory, "trace.json")):
        _train(ddp, 1)
        ddp._update_process_group(dist.new_group([0, 1]))  # a new engine: the trace must follow it
        _train(ddp, 2)
    dist.barrier()


def test_trace_follows_a_rebuilt_engine() -> None:
    events, _ = _traced(_trace_across_rebuild)
    for rank in (0, 1):
        forwards = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e["name"] == "forward"]
        assert len(forwards) == 3  # one before the rebuild, two after (only 1 when the rebuild dropped it)


def _profiler_labels() -> list[str]:
    ddp = DDP(make_model("cnn_bn"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _train(ddp, 2, "cnn_bn")
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("gradsync::")})


def test_profiler_shows_gradsync_phases() -> None:
    labels = run_distributed(_profiler_labels, 2)[0]
    assert labels == ["gradsync::finalize", "gradsync::forward", "gradsync::reduce_bucket", "gradsync::sync_buffers"]


def _stats() -> gradsync.DDPStats:
    torch.manual_seed(0)
    ddp = DDP(UnusedBranch(), find_unused_parameters=True)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    _train(ddp, 4)
    return ddp.stats()


def test_stats_report_buckets_times_bytes_unused_and_hook() -> None:
    stats = run_distributed(_stats, 2)[1]
    assert stats.rank == 1 and stats.world_size == 2 and stats.iterations == 4
    names = {n for b in stats.buckets for n in b.parameter_names}
    assert names == {f"{m}.{p}" for m in ("a", "unused", "sometimes", "head") for p in ("weight", "bias")}
    param_bytes = 3 * (16 * 16 + 16) * 4 + (16 * 4 + 4) * 4
    assert sum(b.nbytes for b in stats.buckets) == param_bytes == stats.bytes_reduced_per_iteration
    assert stats.total_bytes_reduced == 4 * param_bytes
    assert set(stats.unused_parameters) == {"unused.weight", "unused.bias", "sometimes.weight", "sometimes.bias"}
    assert stats.comm_hook == "allreduce_hook" and stats.find_unused_parameters
    assert not stats.buckets_rebuilt  # torch never rebuilds with find_unused_parameters either
    assert stats.avg_forward_s > 0 and stats.avg_backward_s > 0 and stats.avg_comm_s > 0
    assert 0 <= stats.avg_exposed_comm_s <= stats.avg_backward_s


def _stats_table() -> gradsync.DDPStats:
    ddp = DDP(MLP(), bucket_cap_mb=1000 / 2**20)  # 5 buckets (see _trace), rebuilt after iteration 1
    _train(ddp, 5)
    return ddp.stats()


def test_stats_print_as_a_table_and_serialise_as_a_dict() -> None:
    stats = run_distributed(_stats_table, 2)[0]
    assert len(stats.buckets) == 5 and stats.buckets_rebuilt
    # Counted since the rebuild: iterations 2-5 ran on these buckets, each bucket reduced once per iteration.
    assert [b.launches for b in stats.buckets] == [4] * 5
    assert [b.timed for b in stats.buckets] == [4] * 5  # on the host clock every reduction is timed
    assert all(b.avg_reduce_s > 0 for b in stats.buckets)
    table = str(stats)
    lines = table.splitlines()
    assert lines[0].startswith("gradsync DDP, rank 0 of 2: 5 synced iteration(s), 5 bucket(s) rebuilt")
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(5))
    # size, parameter count and launches against the model's own sizes: 4 hidden weights, the rest together
    assert sorted(" ".join(r[1:3]) for r in rows) == sorted(["1.0 KiB"] * 4 + [f"{256 + 16 + 4 * 64} B"]), table
    assert sorted(int(r[3]) for r in rows) == [1, 1, 1, 1, 6] and all(r[5] == "4" for r in rows)
    total = next(line for line in lines if line.split()[:1] == ["total"])
    assert total.split()[1:4] == [f"{MLP_PARAM_BYTES / 1024:.1f}", "KiB", "10"]
    exposed = next(line for line in lines if "exposed communication" in line)
    assert f"{100 * stats.avg_exposed_comm_s / stats.avg_backward_s:.0f}% of backward" in exposed
    assert len(max(lines, key=len)) < 160, "one line per row, not one long repr"
    values = stats.as_dict()
    assert json.loads(json.dumps(values)) == values  # plain values a logger can take
    assert values["buckets"][0]["launches"] == 4 and values["iterations"] == 5
    assert values["exposed_comm_share"] == pytest.approx(stats.avg_exposed_comm_s / stats.avg_backward_s)


def _divergence(perturb: bool) -> str:
    rank, _ = rank_world()
    model = MLP()
    ddp = DDP(model)
    ddp.enable_divergence_check(every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(6):
            _train(ddp, 1)
            opt.step()
            if perturb and step == 2 and rank == 1:
                with torch.no_grad():  # a rank-dependent update: the replicas drift apart
                    model.layers[2][0].bias[3] += 1e-6
    except RuntimeError as error:
        return str(error)
    return ""


def test_divergence_is_detected_and_named() -> None:
    for rank, message in enumerate(run_distributed(_divergence, 2, True)):
        assert "'layers.2.0.bias' differs between rank 0 and rank(s) [1]" in message, message
        assert f"seen on rank {rank}" in message


def test_no_false_divergence_alarm() -> None:
    assert run_distributed(_divergence, 2, False) == ["", ""]


def _skipped_backward(rebuild: str = "") -> str:
    rank, world = rank_world()
    ddp = DDP(MLP())
    ddp.enable_desync_detection(timeout_s=20)
    if rebuild == "static graph":  # a rebuilt engine: the detector must come along
        ddp._set_static_graph()
    elif rebuild == "new group":  # a new one, over the new group's members
        ddp._update_process_group(dist.new_group([0, 1]))
    _train(ddp, 1)
    x, _ = global_batch("mlp", world, 9)
    if rank == 1:
        ddp(shard(x, rank, world))  # a forward whose backward rank 1 forgets
    with pytest.raises(RuntimeError) as error:
        _train(ddp, 1)
    return str(error.value)


@pytest.mark.parametrize("rebuild", ["", "static graph", "new group"])
def test_desync_names_each_ranks_position(rebuild: str) -> None:
    """Also after the engine is rebuilt (``_set_static_graph``, ``_update_process_group``): without the
    detector the ranks' mismatched all-reduces would pair up silently, and no message name positions."""
    for message in run_distributed(_skipped_backward, 2, rebuild, isolated=True):
        assert "ranks disagree on the next collective" in message
        assert "rank 0 is about to issue all-reduce of bucket 0" in message and "synced forward #2" in message
        assert "rank 1 is about to issue all-reduce of bucket 0" in message and "synced forward #3" in message


def _desync_over_subgroups() -> float:
    """Two DDPs over two subgroups of four processes, desync detection on in both: each island's members make
    their helper group alone ([Note: groups made by their members]); the island's gradients are its own."""
    rank, world = rank_world()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    island = rank // 2
    ddp = DDP(make_model("mlp"), process_group=groups[island])
    ddp.enable_desync_detection(timeout_s=20)
    x, y = global_batch("mlp", world, 0)
    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    reference = make_model("mlp")
    reference_step(reference, shard(x, island, 2), shard(y, island, 2), 2)  # the island's two shards
    worst = max(
        ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
        for p, q in zip(ddp.parameters(), reference.parameters())
    )
    for group in groups:
        dist.destroy_process_group(group)
    return worst


def test_desync_detection_over_subgroups() -> None:
    assert max(run_distributed(_desync_over_subgroups, 4, isolated=True, timeout_s=60)) <= 1e-6


def _missing_rank() -> str:
    rank, _ = rank_world()
    ddp = DDP(MLP())
    ddp.enable_desync_detection(timeout_s=3)
    _train(ddp, 1)
    if rank == 1:
        return ""  # rank 1 stops training without telling anyone
    with pytest.raises(RuntimeError) as error:
        _train(ddp, 1)
    return str(error.value)


def test_desync_names_the_missing_rank_on_timeout() -> None:
    message = run_distributed(_missing_rank, 2, isolated=True)[0]
    assert "not every rank reached a collective within 3s" in message
    assert "Ranks 1 failed to pass monitoredBarrier" in message


def _find_unused_warning() -> list[str]:
    ddp = DDP(MLP(), find_unused_parameters=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(ddp, 3)
    return [str(w.message) for w in caught if "find_unused_parameters=True" in str(w.message)]


def test_find_unused_parameters_without_unused_warns_once() -> None:
    for messages in run_distributed(_find_unused_warning, 2):
        assert len(messages) == 1 and "pass find_unused_parameters=False" in messages[0]
