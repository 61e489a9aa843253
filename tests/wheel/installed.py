"""What a wheel installed into a fresh environment must hold, checked from inside it (make wheel-check).

Run with that environment's python, from outside the checkout: every module of the package
imports, from site-packages (nothing resolves to src/); the public names are there; the
version is the one in the distribution's metadata; py.typed, the start-up .pth and the module
it imports are installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
import site
import sys
from pathlib import Path

import gradsync

PUBLIC = [
    "gradsync",
    "gradsync.diloco",
    "gradsync.elastic",
    "gradsync.elastic_diloco",
    "gradsync.hooks",
    "gradsync.zero",
]


def main() -> None:
    expected = set(sys.argv[1:])  # the modules of src/gradsync in the checkout, from the driver
    package = Path(gradsync.__file__).parent
    site_packages = {Path(p).resolve() for p in site.getsitepackages()}
    assert package.parent.resolve() in site_packages, f"gradsync imported from {package}, not site-packages"
    found = {"gradsync"} | {m.name for m in pkgutil.walk_packages([str(package)], prefix="gradsync.")}
    assert found >= expected, f"modules missing from the wheel: {sorted(expected - found)}"
    for name in sorted(found):
        module = importlib.import_module(name)
        assert Path(module.__file__ or "").resolve().is_relative_to(package.resolve()), (name, module.__file__)
    for name in PUBLIC:
        module = importlib.import_module(name)
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ names what it lacks: {missing}"
    version = importlib.metadata.version("gradsync")
    assert gradsync.__version__ == version, f"gradsync.__version__ {gradsync.__version__} != metadata {version}"
    assert (package / "py.typed").is_file(), "py.typed is not installed: type checkers would ignore the hints"
    root = package.parent
    assert (root / "gradsync-autoinstall.pth").is_file(), "the .pth that GRADSYNC_INSTALL=1 relies on is missing"
    assert (root / "_gradsync_autoinstall.py").is_file(), "_gradsync_autoinstall.py is missing"
    print(f"gradsync {version}: {len(found)} modules import from {root}")


if __name__ == "__main__":
    main()
