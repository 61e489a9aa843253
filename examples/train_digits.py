"""Train a small MLP on scikit-learn's handwritten digits with gradsync's DDP.

Run (this is what ``make demo`` does):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/train_digits.py

Each rank sees its own shard of every epoch (``DistributedSampler``); gradsync averages
the gradients, so all replicas take the same optimizer steps. At the end the script
proves it twice over: the replicas are bitwise identical, and rank 0 retrains the same
model in one process on the concatenated batches and gets the same test accuracy.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
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


def make_model() -> nn.Module:
    # Seeding here (not once at start-up) gives the single-process reference the exact
    # same initial weights as the distributed model.
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def shard_loader(dataset: TensorDataset, rank: int, world_size: int, epoch: int) -> DataLoader:
    """What ``rank`` trains on in ``epoch``: the same shuffle on every rank, a disjoint slice each."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)  # without it every epoch would repeat epoch 0's order
    return DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler)


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    x, y = dataset.tensors
    return (model(x).argmax(dim=1) == y).float().mean().item()


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_distributed(train_set: TensorDataset, test_set: TensorDataset, rank: int, world_size: int) -> DDP:
    model = DDP(make_model())
    optimizer = make_optimizer(model)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(EPOCHS):
        model.train()
        loader = shard_loader(train_set, rank, world_size, epoch)
        loss_sum = torch.zeros(2)  # (sum of per-sample losses, number of samples) on this rank
        for x, y in tqdm(loader, desc=f"epoch {epoch + 1:2d}/{EPOCHS}", leave=False, disable=rank != 0):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()  # gradsync averages the gradients across ranks in here
            optimizer.step()
            loss_sum += torch.tensor([loss.item() * len(y), len(y)])
        # Each rank only saw its shard; the epoch's train loss is over all of them.
        dist.all_reduce(loss_sum)
        if rank == 0:
            # The replicas are identical, so one rank can score the whole test set. It uses
            # the inner module: a forward through the DDP wrapper on one rank alone could
            # issue collectives (buffer sync) the other ranks never join.
            test_acc = accuracy(model.module.eval(), test_set)
            train_loss = (loss_sum[0] / loss_sum[1]).item()
            tqdm.write(f"epoch {epoch + 1:2d}  train loss {train_loss:.4f}  test accuracy {test_acc:.4f}")
    return model


def ranks_that_differ(model: nn.Module, world_size: int) -> list[int]:
    """Gather every rank's parameters; the ranks whose copy is not bitwise rank 0's."""
    mine = flat_parameters(model)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return [r for r in range(1, world_size) if not torch.equal(gathered[0], gathered[r])]


def train_single_process(train_set: TensorDataset, world_size: int) -> nn.Module:
    """The same training in one process: each step's batch is every rank's batch, concatenated.

    Every rank's shard has the same length, so each step's per-rank batches are equally
    large and the mean loss over the concatenation has the average of the per-rank
    gradients as its gradient: the update gradsync's DDP makes.
    """
    model = make_model()
    optimizer = make_optimizer(model)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(EPOCHS):
        loaders = [shard_loader(train_set, r, world_size, epoch) for r in range(world_size)]
        for batches in zip(*loaders):
            x = torch.cat([x for x, _ in batches])
            y = torch.cat([y for _, y in batches])
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    return model


def main() -> int:
    torch.set_num_threads(1)  # two ranks share a small CPU; more threads only fight each other
    dist.init_process_group(backend="gloo")  # torchrun provides rank, world size and address
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train_set, test_set = load_splits()
    if rank == 0:
        print(
            f"{world_size} ranks, {len(train_set)} training and {len(test_set)} test digits, "
            f"batch {BATCH_PER_RANK} per rank, {EPOCHS} epochs"
        )

    model = train_distributed(train_set, test_set, rank, world_size)

    differ = ranks_that_differ(model, world_size)
    identical = not differ
    if rank == 0:
        print(f"replicas identical: {identical}")
        if differ:
            print(f"ranks {differ} hold different parameters than rank 0", file=sys.stderr)
        reference = train_single_process(train_set, world_size)
        gap = (flat_parameters(reference) - flat_parameters(model.module)).abs().max().item()
        print(
            f"test accuracy: distributed {accuracy(model.module.eval(), test_set):.4f}, "
            f"single process {accuracy(reference.eval(), test_set):.4f} "
            f"(largest parameter difference {gap:.2e})"
        )
    # Keep the other ranks alive while rank 0 trains the reference, then leave together.
    dist.barrier()
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
