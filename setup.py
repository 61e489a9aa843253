"""Puts gradsync-autoinstall.pth into site-packages; everything else is in pyproject.toml.

Its one line lets ``GRADSYNC_INSTALL=1`` give gradsync's DDP to scripts that never import
gradsync (src/_gradsync_autoinstall.py). A .pth works only at the top of site-packages,
which pyproject.toml cannot ask for (``data-files`` lands under the environment's prefix,
and editable installs skip it), so two build commands add it:

- ``build_py`` writes it at the top of build_lib, which a wheel installs into site-packages;
- ``editable_wheel`` (``pip install -e .``) does not package build_lib, so the file is added
  to the editable wheel it built, with its RECORD line: pip installs it and uninstalls it.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "gradsync-autoinstall.pth"
# One line: site runs lines that start with "import". The check comes first, so a start-up
# without the variable imports nothing.
PTH_LINE = (
    'import os; os.environ.get("GRADSYNC_INSTALL", "0") not in ("", "0") and __import__("_gradsync_autoinstall")\n'
)


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        Path(self.build_lib).mkdir(parents=True, exist_ok=True)
        Path(self.build_lib, PTH_NAME).write_text(PTH_LINE)


class EditableWheelWithPth(editable_wheel):
    def run(self) -> None:
        super().run()
        built = sorted(Path(self.dist_dir).glob("*editable*.whl"), key=lambda p: p.stat().st_mtime)
        if not built:
            raise RuntimeError(f"setup.py: no editable wheel in {self.dist_dir} to add {PTH_NAME} to")
        _add_to_wheel(built[-1], PTH_NAME, PTH_LINE.encode())


def _add_to_wheel(wheel: Path, name: str, content: bytes) -> None:
    """Rewrite ``wheel`` with ``name`` at its top and a RECORD line for it."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(wheel) as old:
        entries = [(info, old.read(info)) for info in old.infolist() if info.filename != name]
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as new:
        for info, data in entries:
            if info.filename.count("/") == 1 and info.filename.endswith(".dist-info/RECORD"):
                data = f"{name},sha256={digest},{len(content)}\n".encode() + data
            new.writestr(info, data)
        new.writestr(name, content)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
