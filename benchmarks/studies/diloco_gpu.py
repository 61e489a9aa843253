"""DiLoCo on one GPU: inner step time against plain training, the outer step by parts, peak memory (issue #45).

Run from the repository root on a machine with a CUDA GPU (single process, about 90 s on an H200):

    python -m benchmarks diloco_gpu [--rounds 2] [--sync-every 100] [--batch 4] [--out DIR]

which is exactly ``OMP_NUM_THREADS=1 python -m benchmarks.studies.diloco_gpu [options]``;
tests/gpu/run_on_device.sh runs it and keeps its output in bench.log. ``--tiny`` runs a model of a few
thousand parameters for a few steps, on the CPU when there is no GPU: it checks that the script works,
and its numbers mean nothing.

The model: GPT-shaped, about 1.0 B parameters (18 layers x 2048, 16 heads, vocabulary 50257, context
1024, tied embeddings), bf16 autocast, SDPA attention, random tokens, fused AdamW. One replica per
process: this process is a world of one (NCCL), and DiLoCo's exchange runs over its own gloo group of
one, so nothing crosses a network; what is measured is what DiLoCo costs the replica itself (its copies
between the GPU and the host, the host's outer optimizer step, the merge), the part a faster link
cannot hide. Contenders, over one model and one inner optimizer (each DiLoCo keeps its own
theta_global; their outer steps move the shared weights, which changes no timing):

- ``plain``: the inner optimizer alone;
- ``diloco``: DiLoCo, ``sync_every`` H (100), one fragment, blocking (``delay = 0``), outer state on the host;
- ``streaming``: Streaming DiLoCo, H, 4 fragments, ``delay = 2``, outer state on the host.

Reported:

- **step time**: each contender runs H steps in a block (so every DiLoCo outer step of a round falls in
  it), the blocks interleaved over ``--rounds`` rounds; a block's wall time (``torch.cuda.synchronize``
  at both ends) over H is its mean step time; the ratio against ``plain`` is the median of per-round
  ratios with a 90% bootstrap interval (lib/common.py's ``paired_ratio``). Target: <= 1.01x.
- **the outer step by parts**, for one fragment of the streaming configuration, for both placements
  (``outer_state="host"`` and ``"device"``), each part timed alone with the GPU idle before it: to the
  host (gather, copy down, ``theta - local``), the exchange, the outer optimizer's step, back (copy up
  and merge); medians over ``--parts`` repetitions.
- **peak memory**: ``torch.cuda.max_memory_allocated`` over a round of each DiLoCo, built alone, above
  plain training's over the same steps, against the largest fragment's fp32 size (the bound of the
  host placement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync.diloco as diloco
from benchmarks.lib.common import free_port, mib, paired_ratio, revision

FULL = {"vocab": 50257, "context": 1024, "width": 2048, "layers": 18, "heads": 16}
TINY = {"vocab": 256, "context": 32, "width": 64, "layers": 2, "heads": 2}


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for t in self.qkv(self.ln1(x)).chunk(3, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


class Trainer:
    """One model, its inner optimizer and a fixed batch; ``step(stepper)`` is one training step."""

    def __init__(self, shape: dict[str, int], batch: int, device: torch.device) -> None:
        torch.manual_seed(0)
        self.device, self.vocab = device, shape["vocab"]
        self.model = GPT(**shape).to(device)
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        tokens = torch.randint(0, shape["vocab"], (batch, shape["context"] + 1), device=device)
        self.tokens, self.targets = tokens[:, :-1], tokens[:, 1:]

    def step(self, stepper: Callable[[], Any]) -> None:
        self.inner.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.model(self.tokens)
            loss = F.cross_entropy(logits.reshape(-1, self.vocab).float(), self.targets.reshape(-1))
        loss.backward()
        stepper()

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(trainer: Trainer, name: str, H: int, outer_state: str = "host") -> diloco.DiLoCo:
    fragments, delay = (1, 0) if name == "diloco" else (4, 2)
    return diloco.DiLoCo(trainer.model, trainer.inner, H, fragments=fragments, delay=delay, outer_state=outer_state)


def block_s(trainer: Trainer, stepper: Callable[[], Any], steps: int) -> float:
    """Mean wall seconds per step over ``steps`` steps, the GPU idle at both ends."""
    sync(trainer.device)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step(stepper)
    sync(trainer.device)
    return (time.perf_counter() - start) / steps


def peak_above_plain(trainer: Trainer, H: int) -> dict[str, Any]:
    """Each DiLoCo alone over one round: its peak memory above plain training's over as many steps."""
    if trainer.device.type != "cuda":
        return {}
    torch.cuda.reset_peak_memory_stats()
    block_s(trainer, trainer.inner.step, H)
    plain = torch.cuda.max_memory_allocated()
    found: dict[str, Any] = {"plain_peak_mib": float(mib(plain))}
    for name in ("diloco", "streaming"):
        outer = build(trainer, name, H)
        torch.cuda.reset_peak_memory_stats()
        block_s(trainer, outer.step, H)
        extra = torch.cuda.max_memory_allocated() - plain
        largest = max(f.numel for f in outer.fragments) * 4
        found[name] = {"above_plain_mib": float(mib(extra)), "largest_fragment_mib": float(mib(largest))}
        outer.close()
        del outer
        torch.cuda.empty_cache()
    return found


def timed_parts(outer: diloco.DiLoCo, device: torch.device) -> dict[str, float]:
    """One outer step of fragment 0, part by part (each timed alone, the GPU idle before it), in ms."""
    fragment, placed = outer.fragments[0], outer.placement
    times: dict[str, float] = {}

    def timed(part: str, run: Callable[[], Any]) -> Any:
        sync(device)
        start = time.perf_counter()
        value = run()
        sync(device)
        times[part] = (time.perf_counter() - start) * 1e3
        return value

    def down() -> torch.Tensor:
        return fragment.outer_gradient() if placed is None else placed.outer_gradient(fragment).wait()

    delta = timed("to_host", down)
    average = timed("exchange", lambda: outer.exchange.average(delta).values)
    assert average is not None, "one replica's exchange always has a contributor"

    def step() -> None:
        grad = average.to(fragment.theta.dtype) if placed is None else placed.gradient(fragment, average)
        fragment.theta.grad = grad
        outer.outer_optimizer.step()
        fragment.theta.grad = None

    timed("optimizer", step)
    if placed is not None and placed.on_host:
        timed("back", lambda: placed.land(fragment, outer.schedule.delay, outer.merge, outer.alpha, None))
    else:
        timed("back", lambda: fragment.mix(outer.alpha))
    return times


def parts_by_placement(trainer: Trainer, H: int, repeats: int) -> dict[str, dict[str, float]]:
    found = {}
    for state in ("host", "device"):
        outer = build(trainer, "streaming", H, state)
        samples = [timed_parts(outer, trainer.device) for _ in range(repeats)]
        found[state] = {part: statistics.median(s[part] for s in samples) for part in samples[0]}
        outer.close()
        del outer
        if trainer.device.type == "cuda":
            torch.cuda.empty_cache()
    return found


def interleaved(trainer: Trainer, H: int, rounds: int) -> dict[str, Any]:
    contenders = {"plain": trainer.inner.step}
    outers = {name: build(trainer, name, H) for name in ("diloco", "streaming")}
    contenders.update({name: outer.step for name, outer in outers.items()})
    for stepper in contenders.values():  # warm-up: kernels chosen, pinned buffers touched
        block_s(trainer, stepper, 3)
    per_step: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, stepper in contenders.items():
            per_step[name].append(block_s(trainer, stepper, H))
    for outer in outers.values():
        outer.close()
    found: dict[str, Any] = {"step_ms": {n: [round(s * 1e3, 3) for s in v] for n, v in per_step.items()}}
    for name in outers:
        ratio, low, high = paired_ratio(per_step[name], per_step["plain"], 1)
        found[f"{name}_over_plain"] = [round(ratio, 4), round(low, 4), round(high, 4)]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=100, help="H, inner steps per round")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--parts", type=int, default=3, help="repetitions of the outer step by parts")
    parser.add_argument("--tiny", action="store_true", help="a tiny model for a few steps (CPU if no GPU)")
    parser.add_argument("--out", type=Path, default=None, help="also write diloco_gpu.json here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda and not args.tiny:
        print("diloco_gpu: no CUDA device on this machine (torch.cuda.is_available() is False); --tiny runs on CPU")
        return
    if cuda:
        torch.cuda.set_device(0)
    H = 12 if args.tiny else args.sync_every  # streaming needs delay 2 < H / 4
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    trainer = Trainer(TINY if args.tiny else FULL, 2 if args.tiny else args.batch, device)
    results: dict[str, Any] = {
        "revision": revision(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "parameters": trainer.parameters,
        "sync_every": H,
        "tiny": args.tiny,
    }
    print(json.dumps(results), flush=True)
    results["memory"] = peak_above_plain(trainer, H)
    print(json.dumps({"memory": results["memory"]}), flush=True)
    results["parts_ms"] = parts_by_placement(trainer, H, args.parts)
    print(json.dumps({"parts_ms": results["parts_ms"]}), flush=True)
    results["timing"] = interleaved(trainer, H, args.rounds)
    print(json.dumps({"timing": results["timing"]}), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "diloco_gpu.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
