"""Error feedback on DiLoCo's lossy wire ([Note: error feedback] in gradsync/diloco/error_feedback.py).

The reference is written here from the note, not from gradsync's wire formats: int8 and int4
rounding by hand (one scale per 1024 / 256 values, ``max |x| / 127`` / ``7``, round to nearest,
clamp), the
exchange's pieces (``torch.tensor_split`` of the outer gradient, piece ``j`` summed by replica
``j`` in rank order), every replica simulated in one process. Negative controls: the simulation
without feedback, and with the sender's half of it only, end elsewhere; a resume without the
residuals differs from the uninterrupted run.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync.diloco as diloco
from test_diloco import mlp_batch, relative, train_replica
from test_diloco_streaming import ADAMW, _train_and_save

from harness import run_distributed
from models import loss_fn, make_model, rank_world

pytestmark = pytest.mark.timeout(90)

# wire -> (levels a side, values per scale), as docs/diloco.md states them
FORMATS = {"int8": (127, 1024), "int4": (7, 256)}


def rounded(x: torch.Tensor, wire: str) -> torch.Tensor:
    """What the wire leaves of ``x``: per chunk ``round(x / s) * s``, ``s = max |x| / levels``, clamped."""
    levels, chunk = FORMATS[wire]
    out = torch.empty_like(x)
    for c in range(0, x.numel(), chunk):
        part = x[c : c + chunk]
        s = part.abs().max() / levels
        s = s if s > 0 else torch.ones_like(s)
        out[c : c + chunk] = torch.round(part / s).clamp(-levels, levels) * s
    return out


def exchange(
    deltas: list[torch.Tensor],
    sent: list[torch.Tensor],
    owned: list[torch.Tensor],
    sender: bool,
    owner: bool,
    wire: str,
) -> torch.Tensor:
    """One exchange of every replica's ``delta``; ``sent[r]`` / ``owned[j]`` (replica r's residual, piece j's
    owner's residual) are updated in place when the feedback is on."""
    world = len(deltas)
    contributions = [d + s if sender else d for d, s in zip(deltas, sent)]
    pieces = [torch.tensor_split(c, world) for c in contributions]
    decoded = [[rounded(p, wire) for p in replica] for replica in pieces]
    for r in range(world):
        if sender:
            sent[r].copy_(contributions[r] - torch.cat(decoded[r]))
    averages = []
    for j in range(world):
        total = decoded[0][j].clone()
        for r in range(1, world):
            total.add_(decoded[r][j])
        mean = total.div_(float(world))
        if owner:
            mean.add_(owned[j])
        back = rounded(mean, wire)
        if owner:
            owned[j].copy_(mean - back)
        averages.append(back)
    return torch.cat(averages)


def simulate(model: nn.Module, world: int, steps: int, H: int, sender: bool, owner: bool, wire: str) -> torch.Tensor:
    """Blocking DiLoCo (one fragment) of ``world`` replicas on ``wire``, with the feedback asked for: theta_global."""
    replicas = [copy.deepcopy(model) for _ in range(world)]
    inners = [ADAMW(m.parameters()) for m in replicas]
    theta = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    outer = diloco.nesterov([theta])
    n = theta.numel()
    sent = [torch.zeros(n) for _ in range(world)]
    owned = [torch.zeros(p.numel()) for p in torch.tensor_split(torch.zeros(n), world)]
    for t in range(steps):
        for r, (m, opt) in enumerate(zip(replicas, inners)):
            x, y = mlp_batch(world, r, t)
            opt.zero_grad()
            loss_fn(m(x), y).backward()
            opt.step()
        if (t + 1) % H == 0:
            deltas = [theta.detach() - torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in replicas]
            theta.grad = exchange(deltas, sent, owned, sender, owner, wire)
            outer.step()
            theta.grad = None
            with torch.no_grad():
                for m in replicas:
                    for p, v in zip(m.parameters(), theta.detach().split([q.numel() for q in m.parameters()])):
                        p.copy_(v.view_as(p))
    return theta.detach().clone()


def _train(H: int, steps: int, wire: str) -> dict:
    rank, world = rank_world()
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    outer = diloco.DiLoCo(model, ADAMW(model.parameters()), sync_every=H, wire=wire, error_feedback=True)
    train_replica(model, outer, range(steps))
    outer.close()
    theta = outer.global_parameters[0].detach().clone()
    gathered = [torch.empty_like(theta) for _ in range(world)]
    dist.all_gather(gathered, theta)
    result = {"identical": all(torch.equal(gathered[0], g) for g in gathered)}
    if rank == 0:
        simulated = {
            kind: simulate(reference, world, steps, H, sender, owner, wire)
            for kind, sender, owner in (("both", True, True), ("sender", True, False), ("none", False, False))
        }
        result.update({kind: relative(theta, value) for kind, value in simulated.items()})
    return result


@pytest.mark.parametrize("world, wire", [(2, "int8"), (3, "int8"), (2, "int4")])
def test_error_feedback_equals_the_simulation_written_from_the_note(world: int, wire: str) -> None:
    result = run_distributed(_train, world, 3, 12, wire, timeout_s=60)
    assert all(r["identical"] for r in result), result  # the same bits on every replica
    difference = result[0]
    assert difference["both"] == 0.0, difference  # bit for bit
    # negative controls: without feedback, or without the owners' half of it, theta_global ends elsewhere
    assert difference["none"] > 1e-4, difference
    assert difference["sender"] > 1e-4, difference


def test_a_resumed_run_with_error_feedback_continues_bitwise() -> None:
    """Saved at step 6 with fragment 0's exchange in flight (H 4, F 2, delay 1): residuals and in-flight ones kept."""
    args = (4, 2, 1, "int8")
    whole = run_distributed(_train_and_save, 2, *args, 14, 14, True, "mix", True, timeout_s=30)
    resumed = run_distributed(_train_and_save, 2, *args, 6, 14, True, "mix", True, timeout_s=30)
    for a, b in zip(whole, resumed):
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    # negative control: the same resume with the residuals zeroed differs
    dropped = run_distributed(_train_and_save, 2, *args, 6, 14, True, "mix", True, True, timeout_s=30)
    assert not all(torch.equal(p, q) for p, q in zip(whole[0], dropped[0]))


def _join(H: int) -> dict:
    rank, world = rank_world()
    model = make_model("mlp")
    outer = diloco.DiLoCo(model, ADAMW(model.parameters()), sync_every=H, wire="int8", error_feedback=True)
    steps = 2 * H if rank == 1 else 4 * H  # replica 1's data ends after two rounds
    with outer.join():
        train_replica(model, outer, range(2 * H))  # replica 1's steps, and its last exchange as a contributor
        last_sent = outer.feedback.of(0).sent.clone()
        last_owned = outer.feedback.of(0).owned.clone()
        train_replica(model, outer, range(2 * H, steps))
    outer.close()
    theta = outer.global_parameters[0].detach().clone()
    gathered = [torch.empty_like(theta) for _ in range(world)]
    dist.all_gather(gathered, theta)
    residuals = outer.feedback.of(0)
    return {
        "identical": all(torch.equal(gathered[0], g) for g in gathered),
        "sent_kept": torch.equal(residuals.sent, last_sent),
        "sent_nonzero": bool(last_sent.abs().sum() > 0),
        "owned_moved": not torch.equal(residuals.owned, last_owned),
    }


def test_a_replica_whose_data_ended_keeps_its_sender_residual() -> None:
    """Inside outer.join() replica 1 sends zeros after its data ends: its sender residual waits, unchanged;
    as the owner of a piece it goes on rounding, and compensating, the averages."""
    first, second = run_distributed(_join, 2, 2, timeout_s=30)
    assert first["identical"] and second["identical"]
    assert second["sent_nonzero"] and second["sent_kept"], second
    assert second["owned_moved"], second
    # negative control: replica 0 trains on, so its own sender residual changed after the same step
    assert not first["sent_kept"], first


def _misuse() -> list[str]:
    model = make_model("mlp")
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    messages = []
    for kwargs, error in (
        ({"wire": "fp32", "error_feedback": True}, ValueError),
        ({"wire": "int8", "error_feedback": "yes"}, TypeError),
    ):
        with pytest.raises(error) as raised:
            diloco.DiLoCo(model, inner, sync_every=2, **kwargs)
        messages.append(str(raised.value))
    with_feedback = diloco.DiLoCo(model, inner, sync_every=2, wire="int8", error_feedback=True)
    state = with_feedback.state_dict()
    with_feedback.close()
    without = diloco.DiLoCo(model, inner, sync_every=2, wire="int8")
    with pytest.raises(ValueError) as raised:
        without.load_state_dict(state)
    without.close()
    messages.append(str(raised.value))
    return messages


def test_misuse_of_error_feedback_is_refused_with_the_fix() -> None:
    fp32, not_bool, checkpoint = run_distributed(_misuse, 2, timeout_s=30)[0]
    assert "wire='bf16', 'int8' or 'int4'" in fp32
    assert "True or False" in not_bool
    assert "error_feedback" in checkpoint and "rank 0" in checkpoint
