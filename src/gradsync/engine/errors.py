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
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]  # 3.11's


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


# ---------------------------------------------------------------------- distributed autograd
def autograd_grad_through_wrapper(rank: int, iteration: int) -> str:
    return (
        "DistributedDataParallel doesn't work with torch.autograd.grad(): it only averages gradients "
        "accumulated into .grad (loss.backward()) or into a distributed autograd context "
        f"(dist_autograd.backward). On rank {rank}, iteration {iteration}, torch.autograd.grad() took "
        "wrapped parameters as inputs and would return this rank's own, unaveraged gradients. Use "
        "loss.backward() and read .grad; for a local gradient on purpose (a gradient penalty), run "
        "that forward under ddp.no_sync() or on ddp.module."
    )


def context_entered_after_forward(rank: int, iteration: int) -> str:
    return (
        f"On rank {rank}, iteration {iteration}: dist_autograd.backward() ran through a forward that "
        "was called outside any distributed autograd context, so the averaged gradients have no "
        "context to go into (this rank's local gradients were sent, so the other ranks did not "
        "hang). Call the DistributedDataParallel forward inside `with dist_autograd.context() as "
        "context_id:` and run dist_autograd.backward(context_id, [loss]) in the same context."
    )


def ordinary_backward_in_context(context_id: int, rank: int, iteration: int) -> str:
    return (
        f"On rank {rank}, iteration {iteration}: the forward ran inside distributed autograd context "
        f"{context_id}, but its backward was an ordinary one (loss.backward()): the averaged gradients "
        "were written to .grad, where DistributedOptimizer does not look, so this rank would not "
        "step its replica. Use dist_autograd.backward(context_id, [loss]) inside the context, or run "
        "the forward outside it to train with .grad and a local optimizer."
    )


def context_released(context_id: int | None, rank: int, iteration: int) -> str:
    return (
        f"On rank {rank}, iteration {iteration}: distributed autograd context {context_id} was released "
        "before the averaged gradients could be written into it. Keep the forward, "
        "dist_autograd.backward and the optimizer step inside one `with dist_autograd.context()` block."
    )


def unsupported_under_dist_autograd(what: str, rank: int) -> str:
    return (
        f"{what} is not supported under distributed autograd (dist_autograd.backward) on rank {rank}: "
        "it works on .grad, which distributed autograd does not write. Use loss.backward() with it, "
        "or train the wrapper without it under the RPC framework."
    )


def average_without_place(names: list[str], rank: int, iteration: int) -> str:
    return (
        f"Parameters {names} got no gradient on rank {rank} in iteration {iteration} but did on other "
        "ranks. Under distributed autograd the average can only be written where the context already "
        "holds a gradient (nothing public adds one), so this rank's DistributedOptimizer would not step "
        "them while the others do. Make every rank's forward use them (e.g. add 0 * their output), or "
        "train with loss.backward() and .grad."
    )


def desync_under_fault_tolerance(rank: int) -> str:
    return (
        f"Desync detection cannot run in the fault-tolerant mode (rank {rank}): its checks are collectives before "
        "every bucket, outside the decided step, so a death would fail them instead of being survived, and each "
        "new generation would need a helper group of its own. Unset GRADSYNC_DEBUG (or leave out "
        "enable_desync_detection) for the fault-tolerant mode."
    )
