"""Train a character-level language model with gradsync's DDP or with DiLoCo, by a flag.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/train_charlm.py --mode ddp
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/train_charlm.py --mode diloco --sync-every 50
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/train_charlm.py --mode diloco \\
        --sync-every 50 --fragments 2 --delay 2 --wire int8 --error-feedback   # Streaming DiLoCo, int8 outer gradients
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/train_charlm.py --mode diloco \\
        --island-size 2                                                 # 2 islands of a 2-process DDP each
    (add ``--zero-stage 2`` to shard AdamW's state and the gradients over each island: gradsync.zero inside)

Fault tolerant (``--elastic``, DiLoCo only): a store that belongs to no trainer, then one torchrun
per replica, so that a dead replica is restarted alone; it is healed from a live one and the others
lose no inner step (docs/diloco.md, Fault tolerance):

    python -m gradsync.elastic.store --port 29400 &
    for r in 0 1 2; do GRADSYNC_STORE=127.0.0.1:29400 GRADSYNC_REPLICAS=3 OMP_NUM_THREADS=1 \\
        torchrun --standalone --nproc-per-node 1 --max-restarts 3 examples/train_charlm.py \\
        --mode diloco --elastic --replica $r & done; wait

The text is the English of ``pydoc_data/topics.py``, which ships with CPython (no download); the
last 10% is held out for validation. The model is a small pre-norm transformer (context 128).
``--mode ddp``: every step's gradients are averaged (gradsync DDP). ``--mode diloco``: each process
(or island) takes ``--sync-every`` AdamW steps on its own batches, then the outer Nesterov step on
the averaged outer gradient (docs/diloco.md). ``--mode local``: LocalSGD (parameter averaging).
Rank 0 prints the validation loss against the wall-clock. With ``--elastic`` each replica's batches
are drawn from (seed, ``--replica``, step), so a restarted replica reads what its slot would have.
"""

from __future__ import annotations

import argparse
import math
import pydoc_data.topics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync.diloco
import gradsync.zero
from gradsync import DistributedDataParallel as DDP
from gradsync import elastic
from gradsync.elastic_diloco import FaultTolerantDiLoCo

CONTEXT = 128


def corpus() -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train, validation) as symbol indices, and the vocabulary size; the last 10% is validation."""
    text = "".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    vocabulary = sorted(set(text))
    index = {c: i for i, c in enumerate(vocabulary)}
    data = torch.tensor([index[c] for c in text], dtype=torch.int64)
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:], len(vocabulary)


class CharLM(nn.Module):
    def __init__(self, vocabulary: int, width: int, layers: int, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.randn(CONTEXT, width) * 0.02)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position[: x.shape[1]]
        h = self.blocks(h, mask=self.causal[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def fragments_of(model: CharLM, args: argparse.Namespace) -> int | list[list[nn.Module | nn.Parameter]]:
    """DiLoCo's fragments: a count (strided over layers), or, with ``--fragment-by block``, blocks
    ``p, p + F, ...`` in fragment ``p``, the embeddings with the first and the final norm and head with the last."""
    if args.fragment_by == "layer":
        return args.fragments
    blocks, count = list(model.blocks.layers), args.fragments
    if len(blocks) < count:
        raise SystemExit(f"--fragment-by block needs --layers >= --fragments ({count})")
    fragments: list[list[nn.Module | nn.Parameter]] = [list(blocks[p::count]) for p in range(count)]
    fragments[0] += [model.embed, model.position]
    fragments[-1] += [model.norm, model.head]
    return fragments


def batch(data: torch.Tensor, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - CONTEXT - 1, (size,), generator=generator)
    x = torch.stack([data[s : s + CONTEXT] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + CONTEXT + 1] for s in starts.tolist()])
    return x, y


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def validation_loss(model: nn.Module, data: torch.Tensor, batches: int = 10, size: int = 32) -> float:
    generator = torch.Generator().manual_seed(12345)  # the same held-out windows every time
    model.eval()
    losses = [loss_of(model, *batch(data, size, generator)).item() for _ in range(batches)]
    model.train()
    return sum(losses) / len(losses)


def adamw(trained: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """The inner optimizer: AdamW, or with ``--zero-stage`` AdamW sharded over the DDP's processes."""
    settings = {"lr": args.lr, "weight_decay": 0.1, "betas": (0.9, 0.95)}
    if args.zero_stage:
        return gradsync.zero.ShardedOptimizer(trained, torch.optim.AdamW, stage=args.zero_stage, **settings)
    return torch.optim.AdamW(trained.parameters(), **settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["ddp", "diloco", "local"], default="diloco")
    parser.add_argument("--steps", type=int, default=600, help="inner steps per process")
    parser.add_argument("--batch", type=int, default=16, help="sequences per process per step")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument(
        "--fragment-by", choices=["layer", "block"], default="layer",
        help="strided over modules holding parameters (default), or over transformer blocks (as Streaming DiLoCo)",
    )  # fmt: skip
    parser.add_argument("--delay", type=int, default=0)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--merge", choices=["mix", "keep_inner_steps"], default="mix", help="with --delay")
    parser.add_argument("--wire", choices=["fp32", "bf16", "int8", "int4"], default="fp32")
    parser.add_argument(
        "--error-feedback",
        action="store_true",
        help="with --wire bf16/int8/int4: what rounding removed goes with the next",
    )
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--island-size", type=int, default=1, help="processes per island (DDP inside, DiLoCo across)")
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="with --mode ddp or --island-size > 1: gradsync.zero shards AdamW over the DDP's processes (0: off)",
    )
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--elastic", action="store_true", help="fault tolerant DiLoCo over gradsync.elastic")
    parser.add_argument("--replica", type=int, default=0, help="with --elastic: this replica's data slot")
    args = parser.parse_args()
    if args.elastic and (args.mode != "diloco" or args.island_size > 1 or args.zero_stage):
        raise SystemExit("--elastic runs --mode diloco with plain replicas (docs/diloco.md)")
    if args.zero_stage and args.mode != "ddp" and args.island_size == 1:
        raise SystemExit("--zero-stage shards over a DDP: use it with --mode ddp or with --island-size > 1")

    torch.set_num_threads(1)
    if args.elastic:
        elastic.init()  # GRADSYNC_STORE, GRADSYNC_REPLICAS; a restarted replica is a joiner
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train, held_out, vocabulary = corpus()
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP and DiLoCo broadcast them anyway)
    model = CharLM(vocabulary, args.width, args.layers)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each process its own batches

    if args.elastic:
        elastic_main(args, model, train, held_out)
        return
    if args.mode == "ddp":
        trained = DDP(model)
        inner = adamw(trained, args)
        stepper = inner
    else:
        trained = model
        if args.island_size > 1:
            if world % args.island_size:
                raise SystemExit(f"--island-size {args.island_size} must divide the {world} processes")
            islands = [list(range(i, i + args.island_size)) for i in range(0, world, args.island_size)]
            groups = [dist.new_group(ranks) for ranks in islands]  # every process makes every group
            trained = DDP(model, process_group=groups[rank // args.island_size])
        inner = adamw(trained, args)
        knobs = {"fragments": fragments_of(model, args), "delay": args.delay, "alpha": args.alpha, "wire": args.wire}
        knobs.update(merge=args.merge, error_feedback=args.error_feedback)
        if args.mode == "local":
            stepper = gradsync.diloco.LocalSGD(trained, inner, sync_every=args.sync_every, **knobs)
        else:

            def outer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
                return torch.optim.SGD(params, lr=args.outer_lr, momentum=0.9, nesterov=True)

            stepper = gradsync.diloco.DiLoCo(trained, inner, args.sync_every, outer_optimizer=outer, **knobs)

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        inner.zero_grad()
        loss_of(trained, *batch(train, args.batch, generator)).backward()
        stepper.step()
        if step % args.eval_every == 0 or step == args.steps:
            # Every replica's own parameters; with DiLoCo they equal theta_global right after an outer step.
            held = validation_loss(model, held_out)
            if rank == 0:
                print(f"step {step:5d}  {time.perf_counter() - start:7.1f} s  validation loss {held:.4f}", flush=True)
    if isinstance(stepper, gradsync.diloco.DiLoCo):
        stepper.close()
        if rank == 0:
            sent = stepper.wire.sent_bytes
            print(f"outer exchange: {sent / 2**20:.2f} MiB sent by rank 0 ({sent / args.steps:.0f} B per inner step)")
    if rank == 0:
        print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f} s (ppl {math.exp(held):.2f})")
    dist.destroy_process_group()


def elastic_main(args: argparse.Namespace, model: nn.Module, train: torch.Tensor, held_out: torch.Tensor) -> None:
    """DiLoCo that goes on when a replica dies; the loop runs on the outer object's step count."""
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))

    def outer_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=args.outer_lr, momentum=0.9, nesterov=True)

    outer = FaultTolerantDiLoCo(
        model, inner, args.sync_every, outer_optimizer=outer_optimizer, fragments=fragments_of(model, args),
        wire=args.wire,
        delay=args.delay, alpha=args.alpha, merge=args.merge, error_feedback=args.error_feedback,
        on_reconfigure=lambda rank, world, step: print(f"replica {args.replica}: now rank {rank} of {world} at "
                                                       f"step {step}", flush=True),
    )  # fmt: skip
    generator = torch.Generator()
    start = time.perf_counter()
    while outer.step_count < args.steps or outer.exchange_in_flight:  # end at a landing: keep the last fragment
        step = outer.step_count + 1
        generator.manual_seed((args.seed * 1000 + args.replica) * 1_000_003 + step)
        loss_of(model, *batch(train, args.batch, generator)).backward()
        outer.step()
        inner.zero_grad()
        if step % args.eval_every == 0 or step == args.steps:
            held = validation_loss(model, held_out)
            print(f"replica {args.replica} step {step:5d}  {time.perf_counter() - start:7.1f} s  validation loss "
                  f"{held:.4f}  ({outer.world_size} replicas)", flush=True)  # fmt: skip
    print(f"replica {args.replica} done: identical theta_global on every replica: {outer.replicas_identical()}")
    dist.barrier()  # nobody leaves while another still compares
    outer.close()


if __name__ == "__main__":
    main()
