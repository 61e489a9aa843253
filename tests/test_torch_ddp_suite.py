"""torch's own gloo/CPU DDP unit tests, run against gradsync (issue #12).

Ported from pytorch's ``test/distributed/test_c10d_gloo.py`` (class
``DistributedDataParallelTest``, which also inherits from ``CommonDistributedDataParallelTest``
in ``test/distributed/test_c10d_common.py``): every test there that runs without a GPU. Each
port keeps torch's model, inputs and asserts (``assertRaisesRegex`` patterns verbatim, as
``pytest.raises(..., match=...)``) and only swaps torch's ``DistributedDataParallel`` for
gradsync's. World size 2, gloo, the default process group of ``harness.run_distributed``.

Not ported: the GPU-gated tests (``skip_if_lt_x_gpu``: the cuda/multi-GPU gloo backends,
``test_save_load_checkpoint``, ``test_global_local_unused_params_grad*``,
``test_find_unused_parameters_when_unused_parameters_empty``, the checkpointing, dataclass
output and SyncBatchNorm tests, ``test_ignored_sharded_tensor``), ``ReducerTest`` (torch's C++
``dist.Reducer`` directly, no DDP) and the non-DDP classes (``ProcessGroupGlooTest``,
``CommTest``, ...), which test torch's process group rather than any DDP.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powerSGD
import torch.nn.functional as F
from torch import nn

from gradsync import DistributedDataParallel

from harness import run_distributed

WORLD_SIZE = 2
LOOPBACK = "lo"  # test_c10d_common.LOOPBACK on Linux
# torch's TestCase seeds every test with common_utils.SEED (1234); the harness reuses worker
# processes across tests, so each worker reseeds itself the same way.
SEED = 1234


def _setup() -> tuple[int, dist.ProcessGroup]:
    """What torch's ``MultiProcessTestCase`` + ``_get_process_group()`` give each test."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    random.seed(SEED)
    return dist.get_rank(), dist.distributed_c10d._get_default_group()


def _assert_equal(actual: torch.Tensor, expected: torch.Tensor, **tolerances: float) -> None:
    """torch's ``TestCase.assertEqual`` for tensors (same default tolerances)."""
    torch.testing.assert_close(actual, expected, **tolerances)


# torch.testing._internal.common_distributed.verify_ddp_error_logged, verbatim but for raising
# AssertionError through assert (importing that module needs the expecttest package).
def verify_ddp_error_logged(model_DDP, err_substr):
    # Verify error was logged in ddp_logging_data.
    ddp_logging_data = model_DDP._get_ddp_logging_data()
    assert "iteration" in ddp_logging_data, "Expected 'iteration' in ddp_logging_data"
    assert "has_error" in ddp_logging_data, "Expected 'has_error' in ddp_logging_data"
    assert "error" in ddp_logging_data, "Expected 'error' in ddp_logging_data"
    logging_err = ddp_logging_data["error"]
    # Remove C++ stacktrace if needed.
    actual = (
        err_substr
        if err_substr.find("\nException raised from ") == -1
        else err_substr.split("\nException raised from ")[0]
    )
    assert actual in logging_err, f"Did not find expected {actual} in ddp logging data error: {logging_err}"


# --------------------------------------------------------------------------- upstream models
# test_c10d_common.Net
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        x = self.fc3(x)
        return F.softmax(x, dim=1)


# test_c10d_common.Task
class Task(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(2, 2))

    def forward(self, x):
        return self.p + x


# test_c10d_common.ModuleForDdpCommHook
class ModuleForDdpCommHook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t0 = Task()

    def forward(self, x, rank):
        return self.t0(x + rank)


# test_c10d_common.SparseGradientModule
class SparseGradientModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(10, 10, sparse=True)

    def forward(self, x):
        return F.softmax(self.embedding(x), dim=1)


# test_c10d_gloo.DistributedDataParallelTest.test_ignored_output
class IgnoredOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return F.softmax(x, dim=1)


# test_c10d_gloo.DistributedDataParallelTest.test_ignored_output_with_unused_parameters
class IgnoredOutputWithUnusedParameters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 4, bias=False)
        self.fc3 = nn.Linear(4, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return F.softmax(x, dim=1)


# --------------------------------------------------------------------------- shared helpers
# CommonDistributedDataParallelTest._prepare_single_device_module
def _prepare_single_device_module(process_group, devices, device_ids, global_batch_size, gradient_as_bucket_view=False):
    model = Net()
    device = devices[0]
    ddp_model = DistributedDataParallel(
        copy.deepcopy(model).to(device),
        device_ids=device_ids,
        process_group=process_group,
        bucket_cap_mb=0.001,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )

    model.to(device)

    input = torch.randn(global_batch_size, 2).to(device)
    target = torch.randn(global_batch_size, 4).to(device)

    return model, ddp_model, input, target


# CommonDistributedDataParallelTest._test_ddp_with_process_group (single-device branch only:
# multi_device=True needs 2 or 4 GPUs per rank)
def _test_ddp_with_process_group(rank, process_group, devices, device_ids, gradient_as_bucket_view=False):
    local_batch_size = 1 if devices is None else len(devices)
    global_batch_size = WORLD_SIZE * local_batch_size

    model, ddp_model, input, target = _prepare_single_device_module(
        process_group, devices, device_ids, global_batch_size, gradient_as_bucket_view
    )
    ddp_logging_data = ddp_model._get_ddp_logging_data()
    assert not ddp_logging_data.get("is_multi_device_module")

    def step_model(model, input, target):
        model.train()
        output = model(input)
        loss = F.mse_loss(output, target.to(output.device))
        loss.backward()

    def update_parameters(model):
        for param in model.parameters():
            with torch.no_grad():
                param -= param.grad
            param.grad = None

    # check two model parameters over 2 iterations
    for iteration in range(2):
        # single cpu/gpu training
        step_model(model, input, target)

        # DDP training, DDP scatters subsets of input_cpu to nodes/GPUs
        step_model(
            ddp_model,
            input[rank * local_batch_size : (rank + 1) * local_batch_size],
            target[rank * local_batch_size : (rank + 1) * local_batch_size],
        )

        # Update weights and run a second iteration to shake out errors
        update_parameters(model)
        update_parameters(ddp_model)
        assert len(list(model.parameters())) == len(list(ddp_model.parameters()))
        for i, j in zip(model.parameters(), ddp_model.parameters()):
            _assert_equal(i, j, rtol=1.3e-06, atol=5e-5)

        # Shuffle the input so that DDP input is different
        torch.manual_seed(1337 + iteration)
        input = input[torch.randperm(global_batch_size)]


# DistributedDataParallelTest._test_gloo_backend
def _test_gloo_backend(devices, device_ids, gradient_as_bucket_view=False):
    rank, process_group = _setup()
    device = devices[-1]
    backend = process_group._get_backend(device)
    backend.create_device(interface=LOOPBACK)
    _test_ddp_with_process_group(rank, process_group, devices, device_ids, gradient_as_bucket_view)


# DistributedDataParallelTest._run_and_verify_sparse_gradients
def _run_and_verify_sparse_gradients(rank, vanilla_model, ddp_model):
    mult = 2
    batch_size = mult * WORLD_SIZE
    criterion = nn.CrossEntropyLoss()
    input = torch.randint(0, 10, [batch_size, 2])
    target = torch.randint(0, 10, [batch_size])

    # Run with entire batch against single process version
    criterion(vanilla_model(input), target).backward()

    # Run with partial batch against multi process version
    partial_input = input.split(mult)[rank]
    partial_target = target.split(mult)[rank]
    criterion(ddp_model(partial_input), partial_target).backward()

    # Check that the gradients are sparse and identical
    vanilla_parameter = next(vanilla_model.parameters())
    ddp_parameter = next(ddp_model.parameters())
    _assert_equal(vanilla_parameter.grad.coalesce(), ddp_parameter.grad.coalesce())


# CommonDistributedDataParallelTest._run_and_verify_hook
def _run_and_verify_hook(rank, model, input, expected_grad):
    # Run forward
    output = model(input, rank)

    # Run backward
    output.mean().backward()

    for p in model.parameters():
        _assert_equal(p.grad, expected_grad)


# CommonDistributedDataParallelTest._simple_hook (a method there; same annotations here)
def _simple_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut = torch.futures.Future()
    fut.set_result(torch.ones_like(bucket.buffer()))

    def fut_then(fut):
        # Add ones to fut's result.
        t = fut.value()
        return t + torch.ones_like(t)

    return fut.then(fut_then)


# --------------------------------------------------------------------------- workers
# upstream: DistributedDataParallelTest.test_gloo_backend_cpu_module
def _gloo_backend_cpu_module() -> None:
    _test_gloo_backend([torch.device("cpu")], None)


# upstream: DistributedDataParallelTest.test_gloo_backend_cpu_module_grad_is_view
def _gloo_backend_cpu_module_grad_is_view() -> None:
    _test_gloo_backend([torch.device("cpu")], None, gradient_as_bucket_view=True)


def _ignore_then_use_outputs(model: nn.Module) -> None:
    """The body both upstream ignored-output tests share."""
    batch_size = 4
    criterion = nn.CrossEntropyLoss()
    input = torch.rand([batch_size, 2], dtype=torch.float)
    target = torch.LongTensor([random.randrange(4) for _ in range(batch_size)])

    # Run a few iterations where we ignore the output.
    for _ in range(4):
        output = model(input)
        del output

    # Run a few iterations where we use the output.
    for _ in range(4):
        output = model(input)
        loss = criterion(output, target)
        loss.backward()


# upstream: DistributedDataParallelTest.test_ignored_output
def _ignored_output() -> None:
    """The output of a model can be ignored; there is no implicit requirement that
    `backward` gets called."""
    _, process_group = _setup()

    model = DistributedDataParallel(
        IgnoredOutput().float(),
        process_group=process_group,
    )
    _ignore_then_use_outputs(model)


# upstream: DistributedDataParallelTest.test_ignored_output_with_unused_parameters
def _ignored_output_with_unused_parameters() -> None:
    """As above, when not all parameters participate in computing the output."""
    _, process_group = _setup()

    model = DistributedDataParallel(
        IgnoredOutputWithUnusedParameters().float(),
        process_group=process_group,
        find_unused_parameters=True,
    )
    _ignore_then_use_outputs(model)


# upstream: DistributedDataParallelTest._test_sparse_gradients, used by test_sparse_gradients
# and test_sparse_gradients_grad_is_view
def _sparse_gradients(gradient_as_bucket_view: bool) -> None:
    rank, process_group = _setup()

    # Ensure initialized weights and inputs are identical across processes
    torch.manual_seed(1337)

    vanilla_model = SparseGradientModule()
    ddp_model = DistributedDataParallel(
        copy.deepcopy(vanilla_model),
        process_group=process_group,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )

    _run_and_verify_sparse_gradients(rank, vanilla_model, ddp_model)


# upstream: DistributedDataParallelTest.test_ddp_comm_hook_future_passing_cpu
def _ddp_comm_hook_future_passing_cpu() -> None:
    """The Future returned by the hook is passed on: the callback sets the value."""
    # upstream also creates an unused FileStore here (noqa: F841); the harness owns the store.
    rank, process_group = _setup()

    # Test on CPU
    cpu_model = DistributedDataParallel(ModuleForDdpCommHook().cpu(), process_group=process_group)

    # Register DDP Communication Hook
    cpu_model.register_comm_hook(None, _simple_hook)

    # check whether the grads are equal to what then callback returns.
    # without the comm_hook, result would be 0.25 * torch.ones(2, 2).
    _run_and_verify_hook(rank, cpu_model, 8, 2 * torch.ones(2, 2))


# upstream: DistributedDataParallelTest.test_ddp_invalid_comm_hook_init
def _ddp_invalid_comm_hook_init() -> None:
    """register_comm_hook checks the hook: callable, and the bucket annotation if given."""
    _, process_group = _setup()

    model = DistributedDataParallel(ModuleForDdpCommHook(), process_group=process_group)

    with pytest.raises(TypeError, match="Communication hook must be callable."):
        model.register_comm_hook(state=None, hook=1)

    with pytest.raises(ValueError, match="bucket annotation should be dist.GradBucket."):

        def comm_hook(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
            return torch.futures.Future()

        model.register_comm_hook(state=None, hook=comm_hook)


# upstream: DistributedDataParallelTest.test_ddp_invalid_comm_hook_return_type
def _ddp_invalid_comm_hook_return_type() -> None:
    """The return annotation is checked if given; a hook that returns something other than a
    Future (and has no annotation) fails in backward with torch's message."""
    rank, process_group = _setup()

    model = DistributedDataParallel(ModuleForDdpCommHook(), process_group=process_group)

    expected_err = "Communication hook: return annotation should be torch.futures.Future"
    with pytest.raises(ValueError, match=expected_err):

        def comm_hook(state: object, bucket: dist.GradBucket) -> int:
            return torch.futures.Future()

        model.register_comm_hook(state=None, hook=comm_hook)

    # torch's helper: reads _get_ddp_logging_data()["iteration"/"has_error"/"error"]
    verify_ddp_error_logged(model, expected_err)

    with pytest.raises(RuntimeError, match="callback must return a torch.futures.Future object, but got"):

        def comm_hook(state: object, bucket: dist.GradBucket):  # noqa: F811 - as upstream
            return 1

        model.register_comm_hook(state=None, hook=comm_hook)

        # Run forward
        output = model(8, rank)

        # Run backward
        output.mean().backward()


# upstream: DistributedDataParallelTest.test_ddp_comm_hook_register_just_once
def _ddp_comm_hook_register_just_once() -> None:
    _, process_group = _setup()

    model = DistributedDataParallel(ModuleForDdpCommHook(), process_group=process_group)

    def dummy_hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result([bucket.buffer()])
        return fut

    model.register_comm_hook(None, dummy_hook)

    with pytest.raises(
        RuntimeError,
        match="register_comm_hook or register_builtin_comm_hook can only be called once.",
    ):
        model.register_comm_hook(None, dummy_hook)


# upstream: DistributedDataParallelTest.test_ddp_comm_hook_sparse_gradients
def _ddp_comm_hook_sparse_gradients() -> None:
    """test_sparse_gradients with a simple all-reduce comm hook (gloo)."""
    rank, process_group = _setup()

    # Ensure initialized weights and inputs are identical across processes
    torch.manual_seed(1337)

    vanilla_model = SparseGradientModule()
    ddp_model = DistributedDataParallel(
        copy.deepcopy(vanilla_model),
        process_group=process_group,
    )

    def allreduce_hook_gloo(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        def div_by_world_size(fut):
            # Divide the result by 2 * world_size.
            return fut.wait()[0] / WORLD_SIZE

        # Prepare allreduced grad bucket tensors by running an async work.
        fut = process_group.allreduce([bucket.buffer()]).get_future()
        return fut.then(div_by_world_size)

    ddp_model.register_comm_hook(None, allreduce_hook_gloo)

    _run_and_verify_sparse_gradients(rank, vanilla_model, ddp_model)


# --------------------------------------------------------------------------- tests
def test_gloo_backend_cpu_module() -> None:
    run_distributed(_gloo_backend_cpu_module, WORLD_SIZE)


def test_gloo_backend_cpu_module_grad_is_view() -> None:
    run_distributed(_gloo_backend_cpu_module_grad_is_view, WORLD_SIZE)


def test_ignored_output() -> None:
    run_distributed(_ignored_output, WORLD_SIZE)


def test_ignored_output_with_unused_parameters() -> None:
    run_distributed(_ignored_output_with_unused_parameters, WORLD_SIZE)


def test_sparse_gradients() -> None:
    run_distributed(_sparse_gradients, WORLD_SIZE, False)


def test_sparse_gradients_grad_is_view() -> None:
    run_distributed(_sparse_gradients, WORLD_SIZE, True)


def test_ddp_comm_hook_future_passing_cpu() -> None:
    run_distributed(_ddp_comm_hook_future_passing_cpu, WORLD_SIZE)


def test_ddp_invalid_comm_hook_init() -> None:
    run_distributed(_ddp_invalid_comm_hook_init, WORLD_SIZE)


def test_ddp_invalid_comm_hook_return_type() -> None:
    # isolated: the hook that returns 1 ends backward with an error; fresh workers keep
    # whatever that leaves behind (a half-finished iteration) out of the other tests.
    run_distributed(_ddp_invalid_comm_hook_return_type, WORLD_SIZE, isolated=True)


def test_ddp_comm_hook_register_just_once() -> None:
    run_distributed(_ddp_comm_hook_register_just_once, WORLD_SIZE)


def test_ddp_comm_hook_sparse_gradients() -> None:
    run_distributed(_ddp_comm_hook_sparse_gradients, WORLD_SIZE)


# upstream: CommonDistributedDataParallelTest.test_invalid_powerSGD_state (inherited by the
# gloo DistributedDataParallelTest). It builds no DDP and needs no process group: it checks
# torch's PowerSGDState, which gradsync users register through register_comm_hook.
def test_invalid_powerSGD_state() -> None:
    for start_powerSGD_iter, use_error_feedback, warm_start in (
        (s, e, w) for s in (0, 1) for e in (True, False) for w in (True, False)
    ):
        if not use_error_feedback and not warm_start:
            continue
        with pytest.raises(
            ValueError,
            match="Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
            "because PowerSGD can only be applied after the first two iterations in DDP.",
        ):
            powerSGD.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=1,
                start_powerSGD_iter=start_powerSGD_iter,
                use_error_feedback=use_error_feedback,
                warm_start=warm_start,
            )
