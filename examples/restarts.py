"""Living with ``torchrun --max-restarts``: a process group per attempt, and a fault to inject.

[Note: restarts and torchrun's shared store]
Since torch 2.5 the c10d rendezvous (``--standalone`` included) hosts one TCPStore in the
torchrun agent and hands it to every attempt: the workers' ``init_process_group()``
rendezvous in it, under the same keys each time. After a restart the new ranks can find
the keys the killed ones left (a dead rank's address), and gloo's connectFullMesh then
fails with "Connection refused" or hangs (pytorch/pytorch#135712, #167288; it happened in
about half of our restarts with torch 2.13). ``init_process_group`` below gives every
attempt its own key prefix, ``attempt-<TORCHELASTIC_RESTART_COUNT>/``.

That count is the same on every rank only when one agent started them all: on several
nodes each agent counts its own restarts, and they can disagree. There the prefix is not
used; set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun instead, which gives each
attempt a fresh store (hosted by rank 0's process).
"""

from __future__ import annotations

import os
import signal
import sys

import torch.distributed as dist


def init_process_group(backend: str = "gloo") -> None:
    """``dist.init_process_group(backend)``, isolated from earlier attempts when that is safe."""
    env = os.environ
    one_agent = env.get("LOCAL_WORLD_SIZE") is not None and env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not one_agent:
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")):
            print(
                "warning: --max-restarts on several nodes with torchrun's shared store: a restarted group may fail "
                "to connect. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (examples/restarts.py).",
                file=sys.stderr,
                flush=True,
            )
        dist.init_process_group(backend=backend)  # torchrun provides rank, world size and address
        return
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"attempt-{attempt}/", store),
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
    )


def crash_if_asked(crash_at_step: int | None, global_step: int) -> None:
    """Fault injection (tests): rank 1 dies by SIGKILL after step ``crash_at_step``, first attempt only.

    torchrun counts restarts in ``TORCHELASTIC_RESTART_COUNT``; a restarted group must not
    crash again, or ``--max-restarts`` would run out.
    """
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if global_step == crash_at_step and dist.get_rank() == 1 and first_attempt:
        print(f"rank 1: killing myself (SIGKILL) after step {global_step}, as --crash-at-step asked", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
