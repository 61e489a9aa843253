"""A process group of W identical ranks emulated in one process, slow on purpose: the race detector.

[Note: the slow emulated group]
Every rank of a data-parallel group that holds the same model and the same batch has the same
gradients, so the group's sum is W times this process's tensor: ``EmulatedGroup`` computes exactly
that, alone, and any reducer that divides by W before summing must hand back the local gradient
*bitwise* (x / 2 * 2 is exact). On CUDA it behaves like NCCL where it matters for ordering: the
collective runs on a private stream that waits for the stream current at the call (NCCL's [Sync
Streams]), ``wait()`` makes the current stream wait for it without blocking the host, and its future is
a CUDA future completed on the private stream. Then it *sleeps* (``torch.cuda._sleep``) before it
writes, so anything that reads the result too early, or writes the input too late, reads or leaves a
wrong value deterministically instead of once in a thousand runs.

On CPU it does the same without streams or sleep (tests/test_cuda_logic.py checks the emulation there,
with gradsync and torch's DDP). It implements what DDPs call: all-reduce (SUM multiplies by W; AVG,
MAX, MIN leave the tensor as it is), broadcast and barrier (identity), all-gather (copies). ``register``
puts it in torch.distributed's table of groups, which ``dist.get_rank(group)`` reads (a default group
must exist).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

SLEEP_CYCLES = 50_000_000  # ~25-40 ms of GPU time on current GPUs: far longer than the tiny models' backward


class EmulatedWork(dist._Work):
    def __init__(
        self, future: torch.futures.Future, done: torch.cuda.Event | None = None, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self._future = future
        self._done = done
        self._device = device

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done is not None:  # like NCCL: the current stream waits, the host does not
            torch.cuda.current_stream(self._device).wait_event(self._done)
        return True

    def is_completed(self) -> bool:
        return self._done is None or self._done.query()

    def get_future(self) -> torch.futures.Future:
        return self._future


class EmulatedGroup(dist.ProcessGroup):
    """``world_size`` identical ranks in this process (rank 0 is this one); see [Note: the slow emulated group]."""

    def __init__(self, world_size: int = 2, sleep_cycles: int = SLEEP_CYCLES) -> None:
        super().__init__(0, world_size)
        self.world_size = world_size
        self.sleep_cycles = sleep_cycles
        self.calls: list[str] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "emulated"

    def getSize(self) -> int:  # noqa: N802 - torch's name
        return self.world_size

    def getRank(self) -> int:  # noqa: N802 - torch's name
        return 0

    def register(self) -> None:
        distributed_c10d._world.pg_group_ranks[self] = {dist.get_rank(): 0}

    def unregister(self) -> None:
        distributed_c10d._world.pg_group_ranks.pop(self, None)

    def _run(self, name: str, tensors: list[torch.Tensor], write: Callable[[], None]) -> EmulatedWork:
        self.calls.append(name)
        device = tensors[0].device if tensors else torch.device("cpu")
        if device.type != "cuda":
            write()
            future = torch.futures.Future()
            future.set_result(tensors)
            return EmulatedWork(future)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # NCCL's [Sync Streams]
        with torch.cuda.stream(stream):
            torch.cuda._sleep(self.sleep_cycles)
            write()
            for tensor in tensors:
                tensor.record_stream(stream)  # the caller may free it before the private stream is done
            future = torch.futures.Future(devices=[device])
            future.set_result(tensors)  # a CUDA future: its waiters wait for this stream, here
            done = torch.cuda.Event()
            done.record(stream)
        return EmulatedWork(future, done, device)

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> EmulatedWork:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)

        def write() -> None:
            if op == dist.ReduceOp.SUM:
                for tensor in tensors:
                    tensor.mul_(self.world_size)
            elif not (op == dist.ReduceOp.AVG or op == dist.ReduceOp.MAX or op == dist.ReduceOp.MIN):
                raise NotImplementedError(f"EmulatedGroup.allreduce: {op}")

        return self._run("allreduce", tensors, write)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> EmulatedWork:
        return self._run("broadcast", tensors, lambda: None)

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: object = None
    ) -> EmulatedWork:
        def write() -> None:
            for outputs, source in zip(output_tensors, input_tensors):
                for output in outputs:
                    output.copy_(source)

        return self._run("allgather", [o for outputs in output_tensors for o in outputs], write)

    def barrier(self, opts: object = None) -> EmulatedWork:
        return self._run("barrier", [], lambda: None)
