"""Messages the reducer raises or warns with: what went wrong, where (parameter, rank, iteration), the fix."""

from __future__ import annotations

from collections.abc import Callable

from ..observability.liveness import roll_call


def unused_parameters(names: list[str], rank: int, iteration: int) -> str:
    return (
        "Expected to have finished reduction in the prior iteration before starting a new one. This "
        "error indicates that your module has parameters that were not used in producing loss. "
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
        "Expected to mark a variable ready only once. "
        f"Parameter '{name}' received its gradient in several pieces during one backward on rank "
        f"{rank} in iteration {iteration} (is its module checkpointed more than once with "
        "use_reentrant=True, or used outside forward while find_unused_parameters treated it as "
        "unused?). Pass static_graph=True, or use torch.utils.checkpoint with use_reentrant=False."
    )


def static_graph_changed(name: str, fired: int, expected: int, rank: int, iteration: int) -> str:
    return (
        "Expected to have finished reduction in the prior iteration before starting a new one. This "
        "error indicates that your training graph has changed in this iteration; this is not "
        f"compatible with static_graph set to True. Parameter '{name}' got its gradient {fired} "
        f"time(s) in iteration {iteration} on rank {rank}, versus {expected} in the first iteration. "
        "Construct DistributedDataParallel with static_graph=False."
    )


def backward_never_finished(rank: int, iteration: int) -> str:
    return (
        f"gradsync: the backward pass of iteration {iteration} started reducing gradients on rank "
        f"{rank} but never finished (an exception during backward?). The replicas may no longer "
        "agree; restart from a checkpoint."
    )


def wrapper_replaced(rank: int) -> str:
    return (
        f"This DistributedDataParallel no longer reduces its parameters on rank {rank}: a newer "
        "DistributedDataParallel was built over the same parameters and took over their gradient "
        "hooks (one wrapper per model; a discarded wrapper must not keep reducing). Use the newer "
        "wrapper, or wrap the module again."
    )


def hook_not_future(hook: str, result: object, bucket: int, rank: int, iteration: int) -> str:
    return (
        "DDP communication hook's callback must return a torch.futures.Future object, but got "
        f"{type(result)}. Comm hook {hook} returned it for bucket {bucket} on rank {rank} in iteration "
        f"{iteration}; return e.g. dist.all_reduce(tensor, async_op=True).get_future()."
    )


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``, also before Python 3.11 (where tracebacks do not print it)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]


def collective_failed(rank: int, where: str, detail: str) -> str:
    """Where this rank was when a collective failed, and which ranks are gone (a roll call)."""
    return f"Rank {rank}: a collective failed during {where}: {detail}. {roll_call(where)}"


def backward_error(problems: list[str | Exception], describe_failure: Callable[[str], str]) -> BaseException:
    """What to raise for a backward's problems: a comm hook's own exception first, as itself, with
    the other problems as notes; else one RuntimeError (``describe_failure`` adds, for a failed
    collective, where this rank was and who died)."""
    exceptions = [e for e in problems if isinstance(e, BaseException)]
    messages = list(dict.fromkeys(e for e in problems if isinstance(e, str)))
    if exceptions:
        error = exceptions[0]
        for message in messages:
            add_note(error, message)
        return error
    message = "; ".join(messages)
    if any(" failed on bucket " in m for m in messages):
        message = describe_failure(message)
    return RuntimeError(message)
