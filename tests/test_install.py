"""``gradsync.install()`` and ``GRADSYNC_INSTALL=1``: torch's DDP name builds gradsync's."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePath
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync

from harness import run_distributed

install_mod = importlib.import_module("gradsync.install")  # gradsync.install is the function
REPO = Path(__file__).resolve().parent.parent
PTH_NAME = "gradsync-autoinstall.pth"


@pytest.fixture(autouse=True)
def not_installed() -> Iterator[None]:
    """Each test starts uninstalled (even under GRADSYNC_INSTALL=1) and leaves the state it found."""
    was = gradsync.installed()
    gradsync.uninstall()
    yield
    gradsync.uninstall()
    if was:
        gradsync.install()


def _torch_ddp() -> type:
    cls = torch.nn.parallel.distributed.DistributedDataParallel
    assert cls is not gradsync.DistributedDataParallel, "the not_installed fixture did not uninstall"
    return cls


def _bindings(cls: type) -> set[tuple[str, str]]:
    """(module, name) of every module-level name in sys.modules bound to ``cls``."""
    return {
        (module_name, name)
        for module_name, module in list(sys.modules.items())
        if isinstance(module, ModuleType)
        for name, value in list(vars(module).items())
        if value is cls
    }


def _rebindable(module_name: str) -> bool:
    """What install may rebind: torch's two homes of the class, and nothing else of torch's or gradsync's."""
    homes = ("torch.nn.parallel", "torch.nn.parallel.distributed")
    return module_name in homes or module_name.partition(".")[0] not in ("torch", "gradsync")


@pytest.fixture
def make_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Write a throwaway module file and import it for real; it leaves sys.modules afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(source: str) -> ModuleType:
        name = f"gs_throwaway_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        made.append(name)
        return importlib.import_module(name)

    yield make
    for name in made:
        sys.modules.pop(name, None)


BINDS_AT_IMPORT = """
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.nn.parallel.distributed import DistributedDataParallel

    ALIAS = DDP
"""


# ---------------------------------------------------------------------------- in process
@pytest.mark.timeout(60)
def test_round_trip_restores_every_binding(make_module: Any) -> None:
    early = make_module(BINDS_AT_IMPORT)
    torch_ddp = _torch_ddp()
    before_torch, before_ours = _bindings(torch_ddp), _bindings(gradsync.DistributedDataParallel)
    assert {(early.__name__, n) for n in ("DDP", "DistributedDataParallel", "ALIAS")} <= before_torch

    gradsync.install()
    assert gradsync.installed()
    assert torch.nn.parallel.DistributedDataParallel is gradsync.DistributedDataParallel
    assert torch.nn.parallel.distributed.DistributedDataParallel is gradsync.DistributedDataParallel
    assert early.DDP is early.DistributedDataParallel is early.ALIAS is gradsync.DistributedDataParallel
    still_torch = _bindings(torch_ddp)
    # gradsync's own modules (ddp.py's base class) and torch's internals keep torch's class.
    assert still_torch == {b for b in before_torch if not _rebindable(b[0])}

    gradsync.uninstall()
    assert not gradsync.installed()
    assert _bindings(torch_ddp) == before_torch
    assert _bindings(gradsync.DistributedDataParallel) == before_ours
    assert torch.nn.parallel.DistributedDataParallel is torch_ddp


@pytest.mark.timeout(60)
def test_install_and_uninstall_are_idempotent(make_module: Any) -> None:
    early = make_module(BINDS_AT_IMPORT)
    torch_ddp = _torch_ddp()
    before = _bindings(torch_ddp)
    gradsync.install()
    after_one = _bindings(gradsync.DistributedDataParallel)
    gradsync.install()
    assert _bindings(gradsync.DistributedDataParallel) == after_one
    gradsync.uninstall()  # one uninstall undoes both installs
    assert _bindings(torch_ddp) == before and early.DDP is torch_ddp
    gradsync.uninstall()
    assert _bindings(torch_ddp) == before and not gradsync.installed()


@pytest.mark.timeout(60)
def test_module_imported_after_install_binds_gradsyncs(make_module: Any) -> None:
    torch_ddp = _torch_ddp()
    gradsync.install()
    late = make_module(BINDS_AT_IMPORT)
    assert late.DDP is late.DistributedDataParallel is gradsync.DistributedDataParallel
    gradsync.uninstall()
    # Documented: install never replaced these names, so uninstall leaves them alone.
    assert late.DDP is gradsync.DistributedDataParallel
    assert torch.nn.parallel.DistributedDataParallel is torch_ddp


@pytest.mark.timeout(60)
def test_uninstall_leaves_a_name_changed_since_install(make_module: Any) -> None:
    early = make_module(BINDS_AT_IMPORT)
    _torch_ddp()
    gradsync.install()
    early.DDP = nn.Linear  # someone else's patch, made while installed
    gradsync.uninstall()
    assert early.DDP is nn.Linear


@pytest.mark.timeout(60)
@pytest.mark.timeout(120)
def test_torch_internal_modules_keep_torchs_class() -> None:
    """In a fresh interpreter: in this one, another test may have imported them while installed."""
    script = textwrap.dedent(
        """
        import importlib
        import torch
        import gradsync
        original = [torch.nn.parallel.DistributedDataParallel]  # a global name would be rebound too
        convert_frame = importlib.import_module("torch._dynamo.convert_frame")
        replicate = importlib.import_module("torch.distributed._composable.replicate")
        gradsync.install()
        assert torch.nn.parallel.DistributedDataParallel is gradsync.DistributedDataParallel
        assert convert_frame.DistributedDataParallel is original[0]
        assert replicate.DistributedDataParallel is original[0]
        assert issubclass(gradsync.DistributedDataParallel, original[0]), "their isinstance checks must hold"
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "GRADSYNC_INSTALL"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.timeout(60)
def test_logged_once_per_process(
    make_module: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_module(BINDS_AT_IMPORT)
    torch_ddp = _torch_ddp()
    rebound = [m for m, _ in _bindings(torch_ddp) if _rebindable(m) and not m.startswith("torch.nn.parallel")]
    monkeypatch.setattr(install_mod, "_announced", False)  # as in a fresh process
    caplog.set_level(logging.INFO, logger="gradsync")
    for _ in range(2):
        gradsync.install()
        gradsync.install()
        gradsync.uninstall()
    records = [r for r in caplog.records if "now builds" in r.getMessage()]
    assert [(r.name, r.levelno, r.getMessage()) for r in records] == [
        (
            "gradsync.install",
            logging.INFO,
            "gradsync: torch.nn.parallel.DistributedDataParallel now builds gradsync.DistributedDataParallel "
            f"({len(rebound)} module names rebound)",
        )
    ]


@pytest.mark.timeout(120)
def test_framework_module_names_are_rebound() -> None:
    lightning_ddp = pytest.importorskip("pytorch_lightning.strategies.ddp", reason="pytorch-lightning not installed")
    fabric_ddp = pytest.importorskip("lightning_fabric.strategies.ddp", reason="lightning-fabric not installed")
    torch_ddp = _torch_ddp()
    assert lightning_ddp.DistributedDataParallel is torch_ddp  # bound at import, before install
    gradsync.install()
    assert lightning_ddp.DistributedDataParallel is gradsync.DistributedDataParallel
    assert fabric_ddp.DistributedDataParallel is gradsync.DistributedDataParallel
    gradsync.uninstall()
    assert lightning_ddp.DistributedDataParallel is fabric_ddp.DistributedDataParallel is torch_ddp


@pytest.mark.timeout(60)
def test_accelerate_reaches_gradsyncs_class() -> None:
    accelerator = pytest.importorskip("accelerate.accelerator", reason="accelerate not installed")
    torch_ddp = _torch_ddp()
    bound = {b for b in _bindings(torch_ddp) if b[0].partition(".")[0] == "accelerate"}
    gradsync.install()
    # Accelerate looks the class up at call time (torch.nn.parallel.DistributedDataParallel(...));
    # any name it binds at import (none in accelerate 1.x) is rebound by the scan.
    assert accelerator.torch.nn.parallel.DistributedDataParallel is gradsync.DistributedDataParallel
    assert not {b for b in _bindings(torch_ddp) if b[0].partition(".")[0] == "accelerate"}
    gradsync.uninstall()
    assert {b for b in _bindings(torch_ddp) if b[0].partition(".")[0] == "accelerate"} == bound


def _torch_name_builds_gradsync() -> list[list[float]]:
    torch_ddp = torch.nn.parallel.distributed.DistributedDataParallel
    assert not gradsync.installed(), "a previous test left gradsync installed in this worker"
    gradsync.install()
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
        assert type(model) is gradsync.DistributedDataParallel, type(model)
        assert isinstance(model, torch_ddp)
        x = torch.full((4, 3), float(dist.get_rank() + 1))
        model(x).sum().backward()
        return model.module.weight.grad.flatten().tolist()
    finally:
        gradsync.uninstall()


@pytest.mark.timeout(120)
def test_torch_constructor_builds_gradsync_and_averages() -> None:
    grads = run_distributed(_torch_name_builds_gradsync, 2)
    # d(sum(Wx + b))/dW = sum of x over the batch: 4 * (rank + 1), averaged over ranks 1 and 2.
    assert grads == [[6.0] * 6, [6.0] * 6]


# ---------------------------------------------------------------------------- other processes
def _python(code: str, cwd: Path, env_value: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != install_mod.ENV_VAR}
    if env_value is not None:
        env[install_mod.ENV_VAR] = env_value
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, *args] if not code else [sys.executable, "-c", textwrap.dedent(code), *args]
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def _require_pth() -> None:
    try:
        files = importlib.metadata.distribution("gradsync").files or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("gradsync is not pip-installed in this interpreter, so it has no .pth file")
    assert PTH_NAME in {PurePath(str(f)).name for f in files}, (
        f"{PTH_NAME} is not installed: reinstall gradsync (pip install -e .; make does it when pyproject.toml changes)"
    )


CHECK_WITHOUT_IMPORTING_GRADSYNC = """
    import importlib.util, sys
    importlib.util.find_spec("torch")  # availability checks (transformers) must not use up the hook
    import torch.nn.parallel
    print(torch.nn.parallel.DistributedDataParallel.__module__, "gradsync" in sys.modules)
"""


@pytest.mark.timeout(120)
def test_env_var_installs_in_a_script_that_never_imports_gradsync(tmp_path: Path) -> None:
    _require_pth()
    assert _python(CHECK_WITHOUT_IMPORTING_GRADSYNC, tmp_path, "1").stdout.split() == ["gradsync.ddp", "True"]
    for off in (None, "0", ""):
        out = _python(CHECK_WITHOUT_IMPORTING_GRADSYNC, tmp_path, off).stdout.split()
        assert out == ["torch.nn.parallel.distributed", "False"], f"GRADSYNC_INSTALL={off!r}"


@pytest.mark.timeout(60)
def test_env_var_costs_nothing_until_torch_is_imported(tmp_path: Path) -> None:
    _require_pth()
    code = "import sys; print('_gradsync_autoinstall' in sys.modules, 'torch' in sys.modules)"
    assert _python(code, tmp_path, "1").stdout.split() == ["True", "False"]
    assert _python(code, tmp_path, None).stdout.split() == ["False", "False"]


@pytest.mark.timeout(60)
def test_importing_gradsync_with_the_env_var_installs(tmp_path: Path) -> None:
    code = """
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_InstallAfterTorch"]  # no .pth hook
        import gradsync, torch
        print(gradsync.installed(), torch.nn.parallel.DistributedDataParallel is gradsync.DistributedDataParallel)
    """
    assert _python(code, tmp_path, "1").stdout.split() == ["True", "True"]
    assert _python(code, tmp_path, "0").stdout.split() == ["False", "False"]


SCRIPT = """
    import os, sys
    import torch
    here = os.path.dirname(os.path.abspath(__file__))
    ddp = torch.nn.parallel.DistributedDataParallel
    print(__name__, ddp.__module__, sys.argv[1:], sys.path[0] == here, os.environ["GRADSYNC_INSTALL"])
"""


@pytest.mark.timeout(60)
def test_run_module_installs_then_runs_the_script(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text(textwrap.dedent(SCRIPT))
    out = _python("", tmp_path, None, "-m", "gradsync.run", "sub/train.py", "--epochs", "3").stdout.split()
    assert out == ["__main__", "gradsync.ddp", "['--epochs',", "'3']", "True", "1"]


@pytest.mark.timeout(60)
def test_run_module_without_a_script_prints_usage(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != install_mod.ENV_VAR}
    result = subprocess.run(
        [sys.executable, "-m", "gradsync.run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "usage: python -m gradsync.run" in result.stderr


ACCELERATE_SCRIPT = """
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    torch.manual_seed(1 + accelerator.process_index)
    accelerator.backward(model(torch.randn(8, 4)).sum())
    optimizer.step()
    weights = accelerator.unwrap_model(model).weight
    # One file per rank: two ranks printing to one pipe can interleave within a line.
    with open(f"result-{accelerator.process_index}.txt", "w") as out:
        out.write(f"RESULT {accelerator.process_index} {type(model).__module__} {weights.sum().item():.8f}\\n")
"""


@pytest.mark.timeout(180)
def test_torchrun_accelerate_script_gets_gradsync_from_the_env_var(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="accelerate not installed")
    _require_pth()
    (tmp_path / "train.py").write_text(textwrap.dedent(ACCELERATE_SCRIPT))
    run = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"]
    _python("", tmp_path, "1", *run)
    lines = [(tmp_path / f"result-{rank}.txt").read_text().split() for rank in range(2)]
    assert lines == [["RESULT", "0", "gradsync.ddp", lines[0][3]], ["RESULT", "1", "gradsync.ddp", lines[0][3]]]


@pytest.mark.timeout(180)
def test_wheel_and_editable_wheel_carry_the_pth(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", minversion="64", reason="setuptools>=64 not installed in this interpreter")
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, project / name)
    shutil.copytree(REPO / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    code = """
        import sys, zipfile
        from setuptools import build_meta
        for build in (build_meta.build_wheel, build_meta.build_editable):
            wheel = zipfile.ZipFile(f"{sys.argv[1]}/{build(sys.argv[1])}")
            record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
            pth = wheel.read("gradsync-autoinstall.pth").decode().strip()
            lines = wheel.read(record).decode().splitlines()
            listed = any(line.startswith("gradsync-autoinstall.pth,sha256=") for line in lines)
            print(build.__name__, pth.startswith("import os;") and "_gradsync_autoinstall" in pth, listed)
    """
    lines = _python(code, project, None, str(tmp_path)).stdout.splitlines()
    out = [line for line in lines if line.startswith("build_")]
    assert out == ["build_wheel True True", "build_editable True True"], out
