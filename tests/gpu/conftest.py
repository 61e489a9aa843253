"""tests/gpu: what only a GPU can check (docs: README "On GPUs"). Every module skips without CUDA, saying so.

The single-process tests share one world-size-1 NCCL group (``nccl_world``), made once per session
with NCCL's asynchronous error handling off, as CUDA-graph capture of NCCL calls requires (torch's
docs/source/notes/cuda.rst, "Usage with DistributedDataParallel"). The two-rank tests run in the gloo
workers of tests/harness.py, each on the one GPU.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from gpu_models import NO_CUDA, deterministic_kernels  # noqa: E402 - found through the path just set

os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
os.environ.setdefault("NCCL_ASYNC_ERROR_HANDLING", "0")
# Bitwise comparisons of two models computing the same thing: kernels that choose their algorithm, or
# add with atomics, must not differ between the two (cuDNN's convolution backward can; cuBLAS across
# streams needs a fixed workspace). The two-rank workers inherit the variable and set cuDNN themselves.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
deterministic_kernels()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def nccl_world() -> Iterator[dist.ProcessGroup]:
    """The default process group: NCCL, world size 1, on cuda:0."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", 0),
        )
    yield dist.group.WORLD
    dist.destroy_process_group()
