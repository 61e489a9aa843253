"""Messages the reducer raises or warns with: what went wrong, where (parameter, rank, iteration), the fix."""

from __future__ import annotations


def unused_parameters(names: list[str], rank: int, iteration: int) -> str:
    return (
        f"Parameters {names} received no gradient on rank {rank} in iteration {iteration}. "
        "Pass find_unused_parameters=True to DistributedDataParallel if the forward pass does not "
        "use them all (or the loss does not depend on every output)."
    )


def nothing_unused(rank: int, iteration: int) -> str:
    return (
        f"find_unused_parameters=True but every parameter got a gradient in iteration {iteration} "
        f"on rank {rank}. The search for unused parameters walks the autograd graph after every "
        "forward; if no parameter is ever unused, pass find_unused_parameters=False to save that time."
    )


def gradient_in_pieces(name: str, rank: int, iteration: int) -> str:
    return (
        f"Parameter '{name}' received its gradient in several pieces during one backward on rank "
        f"{rank} in iteration {iteration} (is its module checkpointed more than once with "
        "use_reentrant=True, or used outside forward while find_unused_parameters treated it as "
        "unused?). Pass static_graph=True, or use torch.utils.checkpoint with use_reentrant=False."
    )


def static_graph_changed(name: str, fired: int, expected: int, rank: int, iteration: int) -> str:
    return (
        f"static_graph=True but parameter '{name}' got its gradient {fired} time(s) in iteration "
        f"{iteration} on rank {rank}, versus {expected} in the first iteration. The graph changed; "
        "construct DistributedDataParallel with static_graph=False."
    )


def backward_never_finished(rank: int, iteration: int) -> str:
    return (
        f"gradsync: the backward pass of iteration {iteration} started reducing gradients on rank "
        f"{rank} but never finished (an exception during backward?). The replicas may no longer "
        "agree; restart from a checkpoint."
    )
