"""Fault-tolerant DiLoCo runs for tests and benchmarks: replicas around a store, and a replay to check them.

``DiLoCoJob`` starts tests/jobs/diloco_worker.py replicas around etcd or a TCPStore hosted here.
``replay`` is the reference, written from torch alone (no gradsync): it keeps one model and one
AdamW per replica, takes each contributor's inner steps on its own batches, averages the outer
gradients of exactly the contributors every committed outer step names (summed in rank order, as
the exchange does, so the bits match), steps a torch Nesterov SGD on theta_global, and heals a
joiner as a copy of its source (parameters and AdamW state). ``check`` asserts what the issue
asks of a run with one death: both survivors in every committed outer step (no inner step
lost), the dead replica's outer step averaged over the two survivors, the restarted replica
healed from a survivor and contributing, every replica bitwise the replay.
(benchmarks/studies/diloco_faults.py runs the same jobs five times each and times them.)
"""

from __future__ import annotations

import copy
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from test_diloco_error_feedback import rounded  # int8 / int4 rounding written by hand

from etcd_support import EtcdJob

sys.path.insert(0, str(Path(__file__).parent / "jobs"))
import diloco_worker  # noqa: E402

H = 4
STEPS = 24  # six outer steps, and more until the restarted replica took part in two


class DiLoCoJob(EtcdJob):
    """Replicas of tests/jobs/diloco_worker.py around etcd (``cluster``) or a TCPStore hosted here (None)."""

    worker = Path(__file__).parent / "jobs" / "diloco_worker.py"


def run_with_a_death(job: EtcdJob, fault: str) -> list[dict]:
    """a, b, c (slots 0-2); c dies at ``fault``; c2, its restart in slot 2, joins and is healed."""
    job.start("a", slot=0)
    job.start("b", slot=1)
    job.wait_arrivals(2)
    job.start("c", slot=2, fault=fault)
    assert job.wait_for_exit("c", timeout_s=60) != 0  # SIGKILLed
    job.start("c2", slot=2)
    return job.finish(["a", "b", "c2"], timeout_s=90)


class Logs(NamedTuple):
    commits: dict[int, list[str]]  # committed outer step -> contributors (replicas, in rank order)
    joins: dict[str, tuple[int, str]]  # joiner -> (first outer step, source)
    slots: dict[str, int]  # replica -> its data slot
    seeds: dict[str, list[int]]  # replica -> its members' data seeds, in island rank order
    excluded: dict[int, list[str]]  # committed outer step -> replicas it left out
    injected: dict[str, tuple[int, str, float]]  # replica -> (inner step, "nan" / "scale", factor)


def read_logs(out: Path) -> Logs:
    """What the replicas logged; a replica is named by ``uuid`` (over islands: its first member's uuid)."""
    commits: dict[int, set[tuple[str, ...]]] = defaultdict(set)
    excluded: dict[int, set[tuple[str, ...]]] = defaultdict(set)
    joins, slots, seeds, injected = {}, {}, {}, {}
    for path in out.glob("*.jsonl"):
        for entry in map(json.loads, path.read_text().splitlines()):
            uuid = entry["uuid"]
            slots[uuid] = entry["slot"]
            islanded = entry.get("islanded", False)
            members = range(entry.get("size", 1))
            seeds[uuid] = [diloco_worker.island_seed(entry["slot"], m) for m in members]
            if not islanded:
                seeds[uuid] = [entry["slot"]]
            if "joined" in entry:
                joins[uuid] = (entry["joined"], entry["source"])
            elif "injected" in entry:
                injected[uuid] = (entry["step"], entry["injected"], entry["factor"])
            else:
                commits[entry["outer_step"]].add(tuple(entry["contributors"]))
                excluded[entry["outer_step"]].add(tuple(entry.get("excluded", [])))
    assert all(len(seen) == 1 for seen in commits.values()), f"replicas disagree on who contributed: {commits}"
    assert all(len(seen) == 1 for seen in excluded.values()), f"replicas disagree on who was left out: {excluded}"
    return Logs(
        {k: list(next(iter(v))) for k, v in commits.items()}, joins, slots, seeds,
        {k: list(next(iter(v))) for k, v in excluded.items()}, injected,
    )  # fmt: skip


def fragment_of_each_parameter(model: nn.Module, fragments: int) -> list[int]:
    """Layer ``i`` (a module holding parameters, in registration order) is in fragment ``i % F`` (strided)."""
    layers = [name for name, m in model.named_modules() if list(m.parameters(recurse=False))]
    return [layers.index(name.rpartition(".")[0]) % fragments for name, _ in model.named_parameters()]


def lossy_average(
    flats: list[torch.Tensor], contributors: list[str], wire: str, residuals: dict[str, list[torch.Tensor]] | None
) -> torch.Tensor:
    """The exchange of one fragment's outer gradients (in rank order) on a rounding wire, written from
    docs/diloco.md: piece ``j`` summed by rank ``j`` from the decoded contributions, divided, rounded
    back. ``residuals[uuid] = [sent, owned]`` (error feedback) are used and replaced in place."""
    world, n = len(flats), flats[0].numel()
    if residuals is not None:
        for uuid in contributors:
            residuals.setdefault(uuid, [torch.zeros(n), torch.zeros(n)])
        flats = [f + residuals[u][0] for f, u in zip(flats, contributors)]
    decoded = [[rounded(piece, wire) for piece in torch.tensor_split(f, world)] for f in flats]
    if residuals is not None:
        for f, mine, uuid in zip(flats, decoded, contributors):
            residuals[uuid][0] = f - torch.cat(mine)
    backs, start = [], 0
    for j, owner in enumerate(contributors):
        total = decoded[0][j].clone()
        for r in range(1, world):
            total.add_(decoded[r][j])
        mean = total.div_(float(world))
        size = mean.numel()
        if residuals is not None:
            mean.add_(residuals[owner][1][start : start + size])
        back = rounded(mean, wire)
        if residuals is not None:
            owned = torch.zeros(n)
            owned[start : start + size] = mean - back
            residuals[owner][1] = owned
        backs.append(back)
        start += size
    return torch.cat(backs)


def replay(
    out: Path,
    fragments: int,
    delay: int = 0,
    merge: str = "mix",
    alpha: float = 0.5,
    wire: str = "fp32",
    error_feedback: bool = False,
    batchnorm: bool = False,
    average_buffers: bool = True,
    heal_inner: bool = True,
) -> tuple[list[torch.Tensor], dict[str, nn.Module]]:
    """theta_global (flat, per fragment) and every replica's model after the committed outer steps.

    Outer step ``k`` syncs fragment ``k % F``: every replica it names computes its outer gradient
    after inner step ``s = (k + 1) H / F``, takes ``delay`` more inner steps, and at the landing
    (after step ``s + delay``) its local fragment becomes theta_global (delay 0), or is merged
    with it as Streaming DiLoCo does (``merge``: the paper's lerp, or theta_global plus the inner
    steps taken since ``s``). Merges are computed on the fragment's flat concatenation, the
    layout the exchange uses, so elementwise kernels see the same alignment. ``batchnorm``: the model
    has BatchNorm; at the landing of each round's last fragment the contributors' floating buffers
    become their mean (summed in rank order) and counters rank 0's (``average_buffers``). ``heal_inner``: a
    joiner takes its source's inner optimizer state, an excluded replica whose own is not finite the first kept
    one's (False: a fresh one, or its own: a negative control)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run: BatchNorm's CPU kernels round differently with more threads
    try:
        return _replay(out, fragments, delay, merge, alpha, wire, error_feedback, batchnorm, average_buffers,
                       heal_inner)  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _replay(
    out: Path,
    fragments: int,
    delay: int,
    merge: str,
    alpha: float,
    wire: str,
    error_feedback: bool,
    batchnorm: bool,
    average_buffers: bool,
    heal_inner: bool,
) -> tuple[list[torch.Tensor], dict[str, nn.Module]]:
    commits, joins, slots, seeds, excluded, injected = read_logs(out)
    assert sorted(commits) == list(range(len(commits))), f"committed outer steps have gaps: {sorted(commits)}"
    period = H // fragments
    theta = [nn.Parameter(p.detach().clone()) for p in diloco_worker.make_model(batchnorm).parameters()]
    owner = fragment_of_each_parameter(diloco_worker.make_model(batchnorm), fragments)
    outer = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True)
    replicas: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    done: dict[str, int] = {}  # inner steps each replica has taken
    # error feedback: per fragment, per replica [sent, owned]; a joiner starts with none (zeros)
    feedback: list[dict[str, list[torch.Tensor]]] | None = [{} for _ in range(fragments)] if error_feedback else None

    def advance(uuid: str, until: int) -> None:
        model, opt = replicas[uuid]
        for step in range(done[uuid], until):
            if uuid in injected and injected[uuid][0] == step:
                inject(model, injected[uuid][1], injected[uuid][2], theta, owner)
            island_step(model, seeds[uuid], step)
            opt.step()
            opt.zero_grad()
        done[uuid] = until

    def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in tensors])

    for k in range(len(commits)):
        for uuid, (first, source) in joins.items():
            if first == k:  # healed after outer step k - 1: a copy of its source replica
                model = copy.deepcopy(replicas[source][0])
                opt = diloco_worker.make_inner(model)
                if heal_inner:
                    opt.load_state_dict(copy.deepcopy(replicas[source][1].state_dict()))
                replicas[uuid], done[uuid] = (model, opt), done[source]
        synced = [i for i in range(len(theta)) if owner[i] == k % fragments]
        start = (k + 1) * period
        deltas = []
        for uuid in commits[k] + excluded.get(k, []):
            if uuid not in replicas:  # a founding replica
                model = diloco_worker.make_model(batchnorm)
                replicas[uuid], done[uuid] = (model, diloco_worker.make_inner(model)), 0
            advance(uuid, start)
            params = list(replicas[uuid][0].parameters())
            if uuid in commits[k]:
                deltas.append([theta[i].detach() - params[i].detach() for i in synced])
        for uuid in commits[k] + excluded.get(k, []):
            advance(uuid, start + delay)  # the inner steps taken while the exchange is in flight
        before = flat([theta[i] for i in synced])
        with torch.no_grad():
            if wire == "fp32" and not error_feedback:
                for j, i in enumerate(synced):
                    total = deltas[0][j].clone()
                    for delta in deltas[1:]:
                        total.add_(delta[j])  # in rank order, as the exchange sums
                    theta[i].grad = total.div_(float(len(deltas)))
            else:
                state = None if feedback is None else feedback[k % fragments]
                average = lossy_average([flat(d) for d in deltas], commits[k], wire, state)
                for i, values in zip(synced, average.split([theta[i].numel() for i in synced])):
                    theta[i].grad = values.view_as(theta[i]).clone()
            outer.step()  # only the synced fragment's parameters have a gradient
            new = flat([theta[i] for i in synced])
            for uuid, delta in zip(commits[k], deltas):
                params = [p for i, p in enumerate(replicas[uuid][0].parameters()) if i in synced]
                local = flat(params)
                if delay == 0:
                    merged = new
                elif merge == "keep_inner_steps":
                    merged = new + (local - (before - flat(delta)))
                else:
                    merged = torch.lerp(new, local, alpha)
                for p, values in zip(params, merged.split([p.numel() for p in params])):
                    p.copy_(values.view_as(p))
            if batchnorm and average_buffers and k % fragments == fragments - 1:  # the round's last landing
                each = [dict(replicas[uuid][0].named_buffers()) for uuid in commits[k]]
                for name, buffer in each[0].items():
                    if buffer.is_floating_point():
                        total = each[0][name].float().clone()
                        for other in each[1:]:
                            total.add_(other[name].float())  # in rank order, as the gather is summed
                        value = total.div_(float(len(each)))
                    else:
                        value = buffer.clone()  # counters: the group's rank 0's
                    for buffers in each:
                        buffers[name].copy_(value)
            for uuid in excluded.get(k, []):  # it starts again from theta_global ([Note: bad contributions ...])
                model, opt = replicas[uuid]
                for p, t in zip(model.parameters(), theta):
                    p.copy_(t)
                state = [v for s in opt.state.values() for v in s.values() if v.is_floating_point()]
                if heal_inner and not all(torch.isfinite(v).all() for v in state):
                    opt.load_state_dict(copy.deepcopy(replicas[commits[k][0]][1].state_dict()))  # the first kept one's
        for t in theta:
            t.grad = None
    flat_theta = [flat([t for i, t in enumerate(theta) if owner[i] == f]) for f in range(fragments)]
    return flat_theta, {uuid: model for uuid, (model, _) in replicas.items()}


def island_step(model: nn.Module, seeds: list[int], step: int) -> None:
    """One inner step's gradients: a plain replica's on its batch; an island's as its DDP averages its members'
    (each member's gradient divided by the island's size, summed in rank order)."""
    if len(seeds) == 1:
        x, y = diloco_worker.batch(seeds[0], step)
        nn.functional.cross_entropy(model(x), y).backward()
        return
    total = None
    for seed in seeds:
        model.zero_grad()
        x, y = diloco_worker.batch(seed, step)
        nn.functional.cross_entropy(model(x), y).backward()
        mine = [p.grad.div(len(seeds)) for p in model.parameters()]
        total = mine if total is None else [a.add_(b) for a, b in zip(total, mine)]
    for p, g in zip(model.parameters(), total):
        p.grad = g


def inject(model: nn.Module, kind: str, factor: float, theta: list[torch.Tensor], owner: list[int]) -> None:
    """The worker's bad contribution, written again: a NaN in the first parameter, or the parameters moved
    ``factor`` times as far from theta_global (computed on each fragment's flat copy, as the worker does)."""
    with torch.no_grad():
        params = list(model.parameters())
        if kind == "nan":
            params[0].view(-1)[0] = float("nan")
            return
        for f in sorted(set(owner)):
            mine = [i for i in range(len(params)) if owner[i] == f]
            global_ = torch.cat([theta[i].detach().reshape(-1) for i in mine])
            local = torch.cat([params[i].detach().reshape(-1) for i in mine])
            moved = global_ + factor * (local - global_)
            for i, values in zip(mine, moved.split([params[i].numel() for i in mine])):
                params[i].copy_(values.view_as(params[i]))


def check(out: Path, results: list[dict], dead_at: int, bitwise: bool = True) -> None:
    commits, joins, *_ = read_logs(out)
    by_name = {r["name"]: r for r in results}
    survivors = {by_name["a"]["uuid"], by_name["b"]["uuid"]}
    # No inner step lost: both survivors contributed to every committed outer step.
    assert all(survivors <= set(c) for c in commits.values()), commits
    assert len(commits[dead_at]) == 2, f"outer step {dead_at} should average the two survivors: {commits[dead_at]}"
    assert by_name["a"]["redone"] >= 1, "the survivors never averaged an outer step again"
    joined_at, source = joins[by_name["c2"]["uuid"]]
    assert source in survivors and dead_at < joined_at <= len(commits) - 2
    assert all(by_name["c2"]["uuid"] in commits[k] for k in range(joined_at, len(commits)))  # it contributes
    assert all(r["identical"] for r in results), results  # theta_global and the outer state, bitwise
    if bitwise:
        check_bitwise(out, results)


def check_bitwise(
    out: Path,
    results: list[dict],
    merge: str | None = None,
    error_feedback: bool | None = None,
    average_buffers: bool = True,
    atol: float = 0.0,
    heal_inner: bool = True,
) -> None:
    """Every replica against the replay; ``merge`` / ``error_feedback`` / ``average_buffers`` / ``heal_inner``
    replay another setting than the run's (negative controls). ``atol``: how far apart the values may be (0: bitwise; a
    ShardedOptimizer's AdamW steps each shard with the same formula as the replay's torch AdamW, but its
    vectorised kernels may round the last bit of an element differently)."""

    def same(mine: torch.Tensor, reference: torch.Tensor) -> bool:
        if atol == 0.0:
            return torch.equal(mine, reference)
        return mine.shape == reference.shape and float((mine - reference).abs().max()) <= atol

    first = results[0]
    feedback = first.get("error_feedback", False) if error_feedback is None else error_feedback
    theta, models = replay(
        out, first["fragments"], first.get("delay", 0), merge or first.get("merge", "mix"), 0.5,
        first.get("wire", "fp32"), feedback, first.get("batchnorm", False), average_buffers, heal_inner,
    )  # fmt: skip
    for result in results:
        saved = torch.load(out / f"{result['name']}.pt")
        assert len(saved["theta"]) == len(theta)
        for mine, reference in zip(saved["theta"], theta):
            assert same(mine, reference), f"{result['name']}: theta_global differs from the replay"
        for (name, mine), reference in zip(saved["model"].items(), models[result["uuid"]].state_dict().values()):
            assert same(mine, reference), f"{result['name']}: parameters differ from the replay ({name})"
