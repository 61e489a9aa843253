"""Train a small MLP on scikit-learn's handwritten digits with gradsync's DDP.

Run (this is what ``make demo`` does):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/train_digits.py

Each rank sees its own shard of every epoch (``DistributedSampler``); gradsync averages
the gradients, so all replicas take the same optimizer steps. At the end the script
proves it twice over: the replicas are bitwise identical, and rank 0 retrains the same
model in one process on the concatenated batches and gets the same test accuracy.

Checkpoints and restarts (README "Checkpointing and restarts", docs/checkpointing.md):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        examples/train_digits.py --checkpoint-dir ckpt --checkpoint-every 10 --dropout 0.2 --crash-at-step 25

checkpoints every 10 optimizer steps (to ``ckpt/``, keeping the last two); rank 1 kills
itself after step 25, torchrun restarts both workers, they resume from step 20, skip the
batches already done, and end with the same weights, bit for bit, as a run that was
never interrupted. Run it again and it resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import io
import itertools
import random
import sys
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from pathlib import Path

import checkpointing  # examples/checkpointing.py and restarts.py: torchrun puts this directory on sys.path
import restarts
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset
from tqdm import tqdm

from gradsync import DistributedDataParallel as DDP

SEED = 0
EPOCHS = 15
BATCH_PER_RANK = 32
LR = 0.05
MOMENTUM = 0.9


def load_splits() -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 8x8 digits, scaled to [0, 1], with a fixed stratified 75/25 split."""
    digits = load_digits()  # bundled with scikit-learn: no download
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=SEED, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def make_model(dropout: float = 0.0) -> nn.Module:
    # Seeding here (not once at start-up) gives the single-process reference the exact
    # same initial weights as the distributed model.
    torch.manual_seed(SEED)
    drop = [nn.Dropout(dropout)] if dropout > 0 else []
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), *drop, nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


class SkipSampler(Sampler[int]):
    """``sampler``'s indices after the first ``skip``: the rest of an interrupted epoch.

    Skipping indices, not batches, resumes without loading the data already trained on.
    """

    def __init__(self, sampler: Sampler[int], skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        assert isinstance(self.sampler, Sized)
        return max(len(self.sampler) - self.skip, 0)


def shard_loader(dataset: TensorDataset, rank: int, world_size: int, epoch: int, skip_steps: int = 0) -> DataLoader:
    """What ``rank`` trains on in ``epoch``: the same shuffle on every rank, a disjoint slice each.

    ``skip_steps`` leaves out the epoch's first batches (the ones a checkpoint already has).
    The loader gets its own generator: by default every ``iter(loader)`` draws a seed from
    the global RNG, which would tie the dropout masks to when loaders are created.
    """
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)  # without it every epoch would repeat epoch 0's order
    return DataLoader(
        dataset,
        batch_size=BATCH_PER_RANK,
        sampler=SkipSampler(sampler, skip_steps * BATCH_PER_RANK),
        generator=torch.Generator(),
    )


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    x, y = dataset.tensors
    return (model(x).argmax(dim=1) == y).float().mean().item()


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@dataclass
class Progress:
    """How far training got; the same on every rank."""

    epoch: int = 0
    steps: int = 0  # optimizer steps done in ``epoch``
    global_step: int = 0  # optimizer steps done in all


def train_distributed(args: argparse.Namespace, train_set: TensorDataset, test_set: TensorDataset) -> DDP:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model(args.dropout))
    optimizer = make_optimizer(model)
    loss_fn = nn.CrossEntropyLoss()
    torch.manual_seed(SEED + 1 + rank)  # dropout: every rank draws its own masks, reproducibly
    progress, loss_sum = Progress(), torch.zeros(2)  # loss_sum: (sum of losses, samples) this epoch
    if args.checkpoint_dir is not None:
        progress, loss_sum = resume(args.checkpoint_dir, model, optimizer)
    while progress.epoch < args.epochs:
        model.train()
        loader = shard_loader(train_set, rank, world_size, progress.epoch, skip_steps=progress.steps)
        desc = f"epoch {progress.epoch + 1:2d}/{args.epochs}"
        total = progress.steps + len(loader)
        # A bar only on a terminal: in a log file (CI, | tee) each refresh would be a line of its own;
        # there the epoch's summary line below is the progress report.
        bar = rank != 0 or not sys.stderr.isatty()
        for x, y in tqdm(loader, desc=desc, initial=progress.steps, total=total, leave=False, disable=bar):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()  # gradsync averages the gradients across ranks in here
            optimizer.step()
            loss_sum += torch.tensor([loss.item() * len(y), len(y)])
            progress.steps += 1
            progress.global_step += 1
            if args.checkpoint_dir is not None and progress.global_step % args.checkpoint_every == 0:
                save_checkpoint(args.checkpoint_dir, model, optimizer, progress, loss_sum)
            restarts.crash_if_asked(args.crash_at_step, progress.global_step)
        report_epoch(model, test_set, loss_sum, progress.epoch, args.epochs)
        progress, loss_sum = Progress(progress.epoch + 1, 0, progress.global_step), torch.zeros(2)
    return model


def report_epoch(model: DDP, test_set: TensorDataset, loss_sum: torch.Tensor, epoch: int, epochs: int) -> None:
    # Each rank only saw its shard; the epoch's train loss is over all of them.
    dist.all_reduce(loss_sum)
    if dist.get_rank() == 0:
        # The replicas are identical, so one rank can score the whole test set. It uses
        # the inner module: a forward through the DDP wrapper on one rank alone could
        # issue collectives (buffer sync) the other ranks never join.
        test_acc = accuracy(model.module.eval(), test_set)
        train_loss = (loss_sum[0] / loss_sum[1]).item()
        tqdm.write(f"epoch {epoch + 1:2d}  train loss {train_loss:.4f}  test accuracy {test_acc:.4f}")


def save_checkpoint(
    directory: Path, model: DDP, optimizer: torch.optim.Optimizer, progress: Progress, loss_sum: torch.Tensor
) -> None:
    """Collective: everything ``resume`` needs to continue exactly where this step left off."""
    shared = {
        "world_size": dist.get_world_size(),
        "epoch": progress.epoch,
        "steps_in_epoch": progress.steps,
        "global_step": progress.global_step,
        "sampler_epoch": progress.epoch,  # what DistributedSampler.set_epoch was given
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
    }
    # Every rank's own: the RNG streams its dropout draws from, its share of the epoch's loss.
    local = {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "loss_sum": loss_sum.clone()}
    checkpointing.save(directory, progress.global_step, shared, local)


def resume(directory: Path, model: DDP, optimizer: torch.optim.Optimizer) -> tuple[Progress, torch.Tensor]:
    """Collective: load the newest valid checkpoint in ``directory`` into this rank, if any."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    loaded = checkpointing.load(directory)
    if rank == 0:
        for path, why in loaded.rejected:
            print(f"checkpoint {path} is corrupt ({why}): moved aside, trying an older one", flush=True)
        used = f"resuming from checkpoint {loaded.path}" if loaded.path else f"no checkpoint in {directory}"
        print(used if loaded.state is not None else f"{used}: starting from scratch", flush=True)
    state = loaded.state
    if state is None:
        return Progress(), torch.zeros(2)
    if state["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {loaded.path} was written by {state['world_size']} ranks, this run has {world_size}: "
            "each rank's shard and RNG state belong to that world size. Restart with the same number of "
            "processes, or point --checkpoint-dir at an empty directory."
        )
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    mine = state["ranks"][rank]
    torch.set_rng_state(mine["torch_rng"])
    random.setstate(mine["python_rng"])
    return Progress(state["epoch"], state["steps_in_epoch"], state["global_step"]), mine["loss_sum"]


def ranks_that_differ(model: nn.Module, world_size: int) -> list[int]:
    """Gather every rank's parameters; the ranks whose copy is not bitwise rank 0's."""
    mine = flat_parameters(model)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return [r for r in range(1, world_size) if not torch.equal(gathered[0], gathered[r])]


def train_single_process(train_set: TensorDataset, world_size: int, epochs: int) -> nn.Module:
    """The same training in one process: each step's batch is every rank's batch, concatenated.

    Every rank's shard has the same length, so each step's per-rank batches are equally
    large and the mean loss over the concatenation has the average of the per-rank
    gradients as its gradient: the update gradsync's DDP makes.
    """
    model = make_model()
    optimizer = make_optimizer(model)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        loaders = [shard_loader(train_set, r, world_size, epoch) for r in range(world_size)]
        for batches in zip(*loaders):
            x = torch.cat([x for x, _ in batches])
            y = torch.cat([y for _, y in batches])
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout after the first layer (default: none)")
    parser.add_argument("--checkpoint-dir", type=Path, help="checkpoint here, and resume from the newest valid one")
    parser.add_argument("--checkpoint-every", type=int, default=20, metavar="N", help="optimizer steps (default: 20)")
    parser.add_argument("--crash-at-step", type=int, metavar="K", help="tests: rank 1 dies after step K, once")
    parser.add_argument("--save-final", type=Path, metavar="PATH", help="rank 0 saves the final state_dict here")
    args = parser.parse_args(argv)
    if args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be at least 1")
    if not 0.0 <= args.dropout < 1.0:
        parser.error("--dropout must be in [0, 1)")
    return args


def save_final(model: nn.Module, path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpointing.write_atomic(path, buffer.getvalue())


def check_against_single_process(
    args: argparse.Namespace, model: DDP, train_set: TensorDataset, test_set: TensorDataset
) -> None:
    if args.dropout > 0:
        print("single-process reference skipped: with dropout every rank draws its own masks")
        return
    reference = train_single_process(train_set, dist.get_world_size(), args.epochs)
    gap = (flat_parameters(reference) - flat_parameters(model.module)).abs().max().item()
    print(
        f"test accuracy: distributed {accuracy(model.module.eval(), test_set):.4f}, "
        f"single process {accuracy(reference.eval(), test_set):.4f} "
        f"(largest parameter difference {gap:.2e})"
    )


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # two ranks share a small CPU; more threads only fight each other
    restarts.init_process_group("gloo")  # torchrun provides rank, world size and address
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.crash_at_step is not None and world_size < 2:
        raise ValueError("--crash-at-step kills rank 1: run with at least 2 processes")
    train_set, test_set = load_splits()
    if rank == 0:
        print(
            f"{world_size} ranks, {len(train_set)} training and {len(test_set)} test digits, "
            f"batch {BATCH_PER_RANK} per rank, {args.epochs} epochs"
        )

    model = train_distributed(args, train_set, test_set)

    differ = ranks_that_differ(model, world_size)
    identical = not differ
    if rank == 0:
        print(f"replicas identical: {identical}")
        if differ:
            print(f"ranks {differ} hold different parameters than rank 0", file=sys.stderr)
        if args.save_final is not None:
            save_final(model.module, args.save_final)
        check_against_single_process(args, model, train_set, test_set)
    # Keep the other ranks alive while rank 0 trains the reference, then leave together.
    dist.barrier()
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
