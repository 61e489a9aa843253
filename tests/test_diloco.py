"""``gradsync.diloco``: the exact special cases against independent references.

* ``LocalSGD`` with H = 1 and inner SGD against gradsync DDP + SGD;
* ``LocalSGD`` with period k against torch's ``PeriodicModelAverager`` (``warmup_steps = k - 1``);
* one and two outer Nesterov steps on a quadratic against a hand computation;
* theta_global and the outer optimizer state bitwise identical on every replica;
* the fragment assignment and schedule (pure), the wire formats (pure);
* ``simulate``: a naive DiLoCo of all replicas in one process, per parameter, written from the
  paper's algorithm, the oracle the streaming tests (test_diloco_streaming.py) compare against.

Every comparison has a negative control beside it: the same check made to fail by a change the
implementation must not make (a period off by one, the other sign, no merge, another step).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

import gradsync.diloco as diloco
from gradsync import DistributedDataParallel as DDP
from gradsync.diloco.fragments import Schedule, strided
from gradsync.diloco.outer_params import fragment_layers
from gradsync.diloco.wire import Bf16, Fp32, Int4, Int8

from harness import run_distributed
from models import global_batch, loss_fn, make_model, rank_world, shard

pytestmark = pytest.mark.timeout(90)


# -- the oracle ----------------------------------------------------------------------------------


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def params_relative(a: nn.Module, b: nn.Module) -> float:
    return max(relative(p.detach(), q.detach()) for p, q in zip(a.parameters(), b.parameters()))


def layer_index(model: nn.Module) -> dict[str, int]:
    """Parameter name -> index of the module that holds it (modules holding parameters, in order)."""
    owners = [prefix for prefix, m in model.named_modules() if list(m.parameters(recurse=False))]
    return {name: owners.index(name.rpartition(".")[0]) for name, _ in model.named_parameters()}


def simulate(
    models: list[nn.Module],
    inner: functools.partial,
    outer: functools.partial,
    batch,
    steps: int,
    H: int,
    F: int = 1,
    delay: int = 0,
    alpha: float = 0.5,
    steps_of: list[int] | None = None,
    by_contributors: bool = True,
    merge: str = "mix",
    fragment_of: dict[str, int] | None = None,
    average_buffers: bool = False,
) -> tuple[list[nn.Module], dict[str, torch.Tensor]]:
    """All replicas in one process, one tensor per parameter: Streaming DiLoCo as the papers state it.

    ``batch(r, t)`` is replica r's (x, y) at inner step t (0-based). Returns the replicas and theta_global.
    ``steps_of[r]``: replica r trains that many steps only (uneven inputs, ``outer.join()``): an exchange
    averages the replicas that trained since the fragment's previous exchange, and the run ends after F
    exchanges in a row that started with every replica out of data. ``merge="keep_inner_steps"``: at
    landing each replica's fragment becomes the new theta_global plus what it moved since the exchange
    started (its parameters at the start are copied then). ``fragment_of``: parameter name -> fragment,
    for fragments the user names (default: layer i in fragment i % F). ``average_buffers``: when the
    last fragment of a round lands, floating buffers become the replicas' mean, others replica 0's.
    """
    steps_of = steps_of or [steps] * len(models)
    inners = [inner(m.parameters()) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    fragment_of = fragment_of or {n: i % F for n, i in layer_index(models[0]).items()}
    theta = {n: nn.Parameter(p.detach().clone()) for n, p in models[0].named_parameters()}
    outer_opt = outer(list(theta.values()))
    in_flight, quiet, t = None, 0, 0
    while quiet < F if any(n != steps for n in steps_of) else t < steps:
        t += 1
        for r, (model, opt) in enumerate(zip(models, inners)):
            if t > steps_of[r]:
                continue
            opt.zero_grad()
            x, y = batch(r, t - 1)
            loss_fn(model(x), y).backward()
            opt.step()
        if t % (H // F) == 0:
            p = (t // (H // F) - 1) % F
            local = [dict(m.named_parameters()) for m in models]
            weights = [1.0 if n > t - H else 0.0 for n in steps_of]
            active = sum(t <= n for n in steps_of)
            total = sum(weights) if by_contributors else len(models)
            mean = {n: sum(w * (theta[n].detach() - lp[n].detach()) for w, lp in zip(weights, local)) for n in names}
            grads = {n: v / total for n, v in mean.items() if fragment_of[n] == p} if sum(weights) else None
            at_start = [{n: lp[n].detach().clone() for n in names if fragment_of[n] == p} for lp in local]
            in_flight = (p, t, grads, active, at_start)
        if in_flight is not None and t == in_flight[1] + delay:
            p, _, grads, active, at_start = in_flight
            quiet = 0 if active else quiet + 1
            in_flight = None
            if average_buffers and p == F - 1:
                with torch.no_grad():
                    for name, buffer in models[0].named_buffers():
                        each = [dict(m.named_buffers())[name] for m in models]
                        value = sum(b.float() for b in each) / len(each) if buffer.is_floating_point() else buffer
                        for b in each:
                            b.copy_(value)
            if grads is None:
                continue
            for n, g in grads.items():
                theta[n].grad = g
            outer_opt.step()
            with torch.no_grad():
                for r, model in enumerate(models):
                    for n, param in model.named_parameters():
                        if n not in grads:
                            continue
                        if delay == 0:
                            param.copy_(theta[n])
                        elif merge == "keep_inner_steps":
                            param.copy_(theta[n] + (param - at_start[r][n]))
                        else:
                            param.copy_(alpha * param + (1 - alpha) * theta[n])
            for n in grads:
                theta[n].grad = None
    return models, {n: v.detach() for n, v in theta.items()}


def mlp_batch(world: int, r: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch("mlp", world, t)
    return shard(x, r, world), shard(y, r, world)


def train_replica(model: nn.Module, outer: diloco.DiLoCo, steps: range) -> None:
    """This process's inner steps ``steps`` (0-based) on its shard of the mlp batches, through ``outer``."""
    rank, world = rank_world()
    for t in steps:
        x, y = mlp_batch(world, rank, t)
        outer.zero_grad()
        loss_fn(model(x), y).backward()
        outer.step()


SGD = functools.partial(torch.optim.SGD, lr=0.05)


# -- pure parts ----------------------------------------------------------------------------------


def test_fragments_are_strided_and_partition_the_layers() -> None:
    for layers, F in ((5, 1), (5, 2), (6, 3), (7, 7)):
        fragments = strided(layers, F)
        assert sorted(i for f in fragments for i in f) == list(range(layers))  # each layer exactly once
        assert all(i % F == p for p, f in enumerate(fragments) for i in f)  # strided, not contiguous
    assert strided(4, 2) != [[0, 1], [2, 3]]  # negative control: the contiguous split is not what we make
    with pytest.raises(ValueError, match="fragments=6"):
        strided(5, 6)


def contiguous_blocks(model: nn.Module) -> list[nn.Module]:
    """Fragments a user names for the test MLP: its first two blocks, then the other two and the head."""
    blocks = list(model.layers)
    return [nn.ModuleList(blocks[:2]), nn.ModuleList([*blocks[2:], model.head])]


def test_fragments_the_user_names_partition_the_model_in_its_order() -> None:
    model = make_model("mlp")
    names = [n for n, _ in model.named_parameters()]
    fragments = fragment_layers(model, contiguous_blocks(model))
    got = [[n for layer in f for n, _ in layer.params] for f in fragments]
    assert got == [names[:4], names[4:]], got  # blocks 0-1, then blocks 2-3 and the head
    # the model's order inside a fragment, however the user's modules nest
    blocks = list(model.layers)
    swapped = fragment_layers(model, [nn.ModuleList([blocks[1], blocks[0]]), nn.ModuleList([*blocks[2:], model.head])])
    assert [[n for layer in f for n, _ in layer.params] for f in swapped] == got
    # parameters named one by one, beside modules (how a parameter the root module holds is named)
    by_parts = fragment_layers(model, [blocks[:2], [*blocks[2:], model.head.weight, model.head.bias]])
    assert [[n for layer in f for n, _ in layer.params] for f in by_parts] == got
    # negative control: the strided split of the same model is another one
    assert [[n for layer in f for n, _ in layer.params] for f in fragment_layers(model, 2)] != got
    for bad, error, match in (
        ([model.layers], ValueError, r"\['head.weight', 'head.bias'\] are in none"),
        ([model.layers, model], ValueError, r"layers.0.0.weight is in fragments\[0\] and fragments\[1\]"),
        ([model, nn.Linear(2, 2)], ValueError, r"fragments\[1\] holds 2 parameter\(s\) that are not the model's"),
        ([model, nn.Tanh()], ValueError, r"fragments\[1\] \(Tanh\) holds no parameters"),
        ([model, "head"], TypeError, r"fragments\[1\] holds a str"),
    ):
        with pytest.raises(error, match=match):
            fragment_layers(model, bad)


@pytest.mark.parametrize("H,F,delay", [(4, 1, 0), (6, 3, 0), (6, 3, 1), (8, 2, 3), (9, 3, 2)])
def test_schedule_syncs_every_fragment_once_per_round(H: int, F: int, delay: int) -> None:
    schedule = Schedule.checked(H, F, delay)
    starts = {t: schedule.starting_after(t) for t in range(1, 4 * H + 1) if schedule.starting_after(t) is not None}
    lands = {t: schedule.landing_after(t) for t in range(1, 4 * H + 1) if schedule.landing_after(t) is not None}
    for k in range(4):  # each round of H steps starts every fragment exactly once, at its own offset
        in_round = [p for t, p in starts.items() if k * H < t <= (k + 1) * H]
        assert sorted(in_round) == list(range(F)), (k, starts)
    assert all(lands[t + delay] == p for t, p in starts.items() if t + delay <= 4 * H)  # lands delay steps later
    assert starts[H] == F - 1 and starts[H // F] == 0
    # next_event names exactly the steps where something happens: DiLoCo.step() checks nothing else
    events, t = [], 0
    while t < 4 * H:
        t = schedule.next_event(t)
        events.append(t)
    assert [e for e in events if e <= 4 * H] == sorted(set(starts) | set(lands))
    # one fragment in flight at a time: every start lands before the next start
    assert all(t + delay < u for t, u in zip(sorted(starts), sorted(starts)[1:]))


def test_schedule_rejects_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="multiple of fragments"):
        Schedule.checked(10, 3, 0)
    with pytest.raises(ValueError, match="delay=2"):
        Schedule.checked(4, 2, 2)
    with pytest.raises(TypeError, match="sync_every must be an int"):
        Schedule.checked(2.0, 1, 0)  # type: ignore[arg-type]


def test_wire_formats_decode_what_was_sent() -> None:
    torch.manual_seed(0)
    x = torch.randn(3000) * torch.logspace(-3, 1, 3000)
    assert torch.equal(Fp32().decode(Fp32().encode(x).clone(), 3000), x)
    assert torch.equal(Bf16().decode(Bf16().encode(x).clone(), 3000), x.to(torch.bfloat16).float())
    int8 = Int8(chunk=256)
    data = int8.encode(x)
    assert data.numel() == int8.encoded_nbytes(3000) == 3000 + 4 * 12
    decoded = int8.decode(data, 3000)
    for c in range(12):  # per chunk: off by at most half a step of that chunk's own scale
        chunk = x[c * 256 : (c + 1) * 256]
        step = chunk.abs().max() / 127
        assert (decoded[c * 256 : (c + 1) * 256] - chunk).abs().max() <= step / 2 * (1 + 1e-5)
    # a piece that starts at an odd byte offset in the received buffer decodes to the same values
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), data])[3:]
    assert torch.equal(int8.decode(shifted, 3000), decoded)
    assert torch.equal(int8.decode(int8.encode(torch.zeros(10)), 10), torch.zeros(10))
    # negative control: one scale for everything would lose the small chunks entirely
    assert (decoded[:256] != 0).any() and (Int8(chunk=4096).decode(Int8(chunk=4096).encode(x), 3000)[:256] == 0).all()


@pytest.mark.parametrize("n", [3000, 2999])
def test_the_int4_wire_decodes_what_was_sent(n: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(n) * torch.logspace(-3, 1, n)
    int4 = Int4(chunk=256)
    data = int4.encode(x)
    chunks = -(-n // 256)
    assert data.numel() == int4.encoded_nbytes(n) == (n + 1) // 2 + 4 * chunks  # two values a byte
    decoded = int4.decode(data, n)
    for c in range(chunks):  # per chunk: a multiple of its own step, off by at most half of it
        chunk, got = x[c * 256 : (c + 1) * 256], decoded[c * 256 : (c + 1) * 256]
        step = chunk.abs().max() / 7
        assert (got - chunk).abs().max() <= step / 2 * (1 + 1e-5)
        levels = got / step  # seven levels a side, the largest entry on the outermost
        assert (levels - torch.round(levels)).abs().max() < 1e-4 and torch.round(levels).abs().max() == 7
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), data])[3:]  # an odd byte offset decodes the same
    assert torch.equal(int4.decode(shifted, n), decoded)
    assert torch.equal(int4.decode(int4.encode(torch.zeros(11)), 11), torch.zeros(11))
    # negative control: a value between two levels is not sent as it was
    assert not torch.equal(decoded, x)


# -- exact special cases ---------------------------------------------------------------------------


def _h1_against_ddp(H: int) -> float:
    rank, world = rank_world()
    model = make_model("mlp")
    reference = DDP(copy.deepcopy(model))
    ref_opt = SGD(reference.parameters())
    inner = SGD(model.parameters())
    outer = diloco.LocalSGD(model, inner, sync_every=H)
    for t in range(20):
        x, y = mlp_batch(world, rank, t)
        for m, opt in ((model, outer), (reference, ref_opt)):
            opt.zero_grad()
            loss_fn(m(x), y).backward()
            opt.step()
    outer.close()
    return params_relative(model, reference.module)


def test_local_sgd_with_h1_equals_ddp() -> None:
    for difference in run_distributed(_h1_against_ddp, 2, 1, timeout_s=30):
        assert difference <= 1e-6, difference
    # negative control: averaging every other step is not DDP
    assert min(run_distributed(_h1_against_ddp, 2, 2, timeout_s=30)) > 1e-4


def _against_periodic_averager(period: int, warmup: int) -> float:
    rank, world = rank_world()
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    inner_kwargs = {"lr": 0.05, "momentum": 0.9}  # the momentum stays per replica in both
    inner = torch.optim.SGD(model.parameters(), **inner_kwargs)
    ref_opt = torch.optim.SGD(reference.parameters(), **inner_kwargs)
    averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
    outer = diloco.LocalSGD(model, inner, sync_every=period)
    for t in range(4 * period + 1):
        x, y = mlp_batch(world, rank, t)
        for m, opt in ((model, outer), (reference, ref_opt)):
            opt.zero_grad()
            loss_fn(m(x), y).backward()
            opt.step()
        averager.average_parameters(reference.parameters())
    outer.close()
    return params_relative(model, reference)


def test_local_sgd_equals_torch_periodic_model_averager() -> None:
    """torch's averager counts its calls from 0 and averages at call ``warmup + k * period`` (0-based), i.e.
    after optimizer step ``warmup + 1 + k * period``; LocalSGD averages after steps ``period, 2 period, ...``.
    ``warmup_steps = period - 1`` makes the two the same steps."""
    for difference in run_distributed(_against_periodic_averager, 3, 3, 2, timeout_s=30):
        assert difference <= 1e-6, difference
    # negative control: torch's default warmup_steps=0 averages after steps 1, 4, 7, ...: one step off
    assert min(run_distributed(_against_periodic_averager, 2, 3, 0, timeout_s=30)) > 1e-4


class Point(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))


def _quadratic(H: int, eta: float, rounds: int) -> list[torch.Tensor]:
    """Replica r descends 0.5 |x - c_r|^2 with SGD; returns theta_global after each outer step."""
    rank, world = rank_world()
    model = Point()
    c = torch.tensor([3.0, 1.0, -1.0]) * (rank + 1)
    outer = diloco.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=eta), sync_every=H)
    thetas = []
    for _ in range(rounds):
        for _ in range(H):
            outer.zero_grad()
            (0.5 * (model.x - c).pow(2).sum()).backward()
            outer.step()
        thetas.append(outer.global_parameters[0].detach().clone())
    outer.close()
    return thetas


def test_outer_nesterov_on_a_quadratic_matches_the_hand_computation() -> None:
    H, eta, lr, mu = 3, 0.1, 0.7, 0.9
    thetas = run_distributed(_quadratic, 2, H, eta, 2, timeout_s=30)[0]
    x0 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    cs = [torch.tensor([3.0, 1.0, -1.0], dtype=torch.float64) * (r + 1) for r in range(2)]
    # H SGD steps on 0.5|x - c|^2 from x: x_H = c + (1 - eta)^H (x - c); delta = theta - x_H (old global - new local)
    delta1 = sum(x0 - (c + (1 - eta) ** H * (x0 - c)) for c in cs) / 2
    buf1 = delta1  # torch's first momentum buffer is the gradient itself
    theta1 = x0 - lr * (delta1 + mu * buf1)  # Nesterov: step along g + mu * buf
    delta2 = sum(theta1 - (c + (1 - eta) ** H * (theta1 - c)) for c in cs) / 2
    buf2 = mu * buf1 + delta2
    theta2 = theta1 - lr * (delta2 + mu * buf2)
    assert relative(thetas[0].double(), theta1) <= 1e-6, (thetas[0], theta1)
    assert relative(thetas[1].double(), theta2) <= 1e-6, (thetas[1], theta2)
    # negative controls: the other sign, and no momentum carried into round 2, are both far off
    assert relative(thetas[0].double(), x0 + lr * (delta1 + mu * buf1)) > 0.1
    assert relative(thetas[1].double(), theta1 - lr * (delta2 + mu * delta2)) > 1e-2
    # the outer step moved theta toward the replicas' minima (mean c = [4.5, 1.5, -1.5]), further than averaging
    mean_c = sum(cs) / 2
    assert (theta1 - mean_c).norm() < (x0 - delta1 - mean_c).norm() < (x0 - mean_c).norm()


def _replicas_bitwise(world_wire: str, fragments: int, delay: int) -> dict:
    rank, world = rank_world()
    model = make_model("mlp")
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    outer = diloco.DiLoCo(model, inner, sync_every=4, fragments=fragments, delay=delay, wire=world_wire)
    same_global, same_momentum, local_differs, outer_steps = [], [], [], 0
    for t in range(12):
        x, y = mlp_batch(world, rank, t)
        outer.zero_grad()
        loss_fn(model(x), y).backward()
        outer.step()
        if outer.schedule.landing_after(t + 1) is None:
            continue
        outer_steps += 1
        states = outer.outer_optimizer.state
        momentum = [states[p]["momentum_buffer"] for p in outer.global_parameters if p in states]
        for tensors, record in ((outer.global_parameters, same_global), (momentum, same_momentum)):
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            record.append(all(torch.equal(gathered[0], g) for g in gathered))
        local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        local_differs.append(not all(torch.equal(gathered[0], g) for g in gathered))
    outer.close()
    return {"global": same_global, "momentum": same_momentum, "local_differs": local_differs, "steps": outer_steps}


@pytest.mark.parametrize("wire,fragments,delay", [("fp32", 1, 0), ("int8", 2, 1), ("bf16", 2, 0)])
def test_global_parameters_and_outer_state_are_bitwise_identical_on_every_replica(
    wire: str, fragments: int, delay: int
) -> None:
    for result in run_distributed(_replicas_bitwise, 3, wire, fragments, delay, timeout_s=30):
        assert result["steps"] == 3 * fragments - (1 if delay else 0)
        assert all(result["global"]) and all(result["momentum"]), result
        # negative control: the check compares something that can differ. With a merge (delay > 0) or with
        # more fragments, the local parameters are never all replaced by theta_global and differ across replicas.
        if delay or fragments > 1:
            assert all(result["local_differs"]), result
