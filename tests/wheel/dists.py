"""The sdist and the wheel as built, before anything installs them (make wheel-check).

Their core metadata must be valid (packaging's validator) and say what pyproject.toml says: the
version written once in src/gradsync/__init__.py, the dependencies, every extra with its
requirements, the README as a markdown long description. The wheel must hold every module of
src/gradsync, py.typed, the start-up .pth of setup.py and the module it imports, and nothing else
at its top; the sdist what rebuilding needs (setup.py, pyproject.toml, README.md, CHANGELOG.md).
"""

from __future__ import annotations

import ast
import re
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.metadata import Metadata
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # mypy, of the dev extra, brings tomli there
    import tomli as tomllib

TOP_LEVEL = {"_gradsync_autoinstall.py", "gradsync-autoinstall.pth"}


def source_version(repo: Path) -> str:
    """``__version__`` in src/gradsync/__init__.py, read as setuptools reads it: without importing."""
    tree = ast.parse((repo / "src" / "gradsync" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return str(ast.literal_eval(node.value))
    raise AssertionError("src/gradsync/__init__.py assigns no __version__")


def package_modules(repo: Path) -> list[str]:
    """Every .py file of src/gradsync, as the path the wheel must hold it at (gradsync/...)."""
    src = repo / "src"
    return sorted(str(p.relative_to(src)) for p in (src / "gradsync").rglob("*.py") if "__pycache__" not in p.parts)


def check_metadata(text: str, repo: Path, version: str) -> Metadata:
    metadata = Metadata.from_email(text, validate=True)  # raises on an invalid field
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    assert metadata.name == "gradsync" and str(metadata.version) == version, (metadata.name, metadata.version)
    assert str(metadata.requires_python) == project["requires-python"], metadata.requires_python
    assert metadata.description_content_type == "text/markdown", metadata.description_content_type
    body = Parser().parsestr(text).get_payload()
    assert body.strip() == (repo / "README.md").read_text().strip(), "the long description is not README.md"
    requires = [Requirement(str(r)) for r in metadata.requires_dist or []]
    plain = sorted(str(r) for r in requires if r.marker is None)
    assert plain == sorted(project["dependencies"]), f"Requires-Dist {plain} != {project['dependencies']}"
    extras = project["optional-dependencies"]
    assert sorted(metadata.provides_extra or []) == sorted(extras), (metadata.provides_extra, sorted(extras))
    for extra, wanted in extras.items():
        got = sorted(
            str(Requirement(f"{r.name}{r.specifier}"))
            for r in requires
            if r.marker and r.marker.evaluate({"extra": extra})
        )
        assert got == sorted(str(Requirement(w)) for w in wanted), f"extra {extra!r}: {got} != {wanted}"
    return metadata


def check_wheel(wheel: Path, repo: Path, version: str) -> list[str]:
    assert wheel.name == f"gradsync-{version}-py3-none-any.whl", wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = f"gradsync-{version}.dist-info"
        check_metadata(zf.read(f"{info}/METADATA").decode(), repo, version)
        assert "Root-Is-Purelib: true" in zf.read(f"{info}/WHEEL").decode()
        record = {line.split(",")[0] for line in zf.read(f"{info}/RECORD").decode().splitlines()}
        pth = zf.read("gradsync-autoinstall.pth").decode() if "gradsync-autoinstall.pth" in names else ""
    missing = sorted(set(package_modules(repo)) - names)
    assert not missing, f"modules of src/gradsync missing from the wheel: {missing}"
    assert "gradsync/py.typed" in names, "py.typed is missing from the wheel: type checkers would ignore its hints"
    assert re.fullmatch(r'import os; .*__import__\("_gradsync_autoinstall"\)\n', pth), f"the .pth is wrong: {pth!r}"
    top = {n for n in names if "/" not in n}
    assert top == TOP_LEVEL, f"the wheel's top level is {sorted(top)}, expected {sorted(TOP_LEVEL)}"
    assert names == record, f"files outside RECORD: {sorted(names ^ record)}"
    return sorted(names)


def check_sdist(sdist: Path, repo: Path, version: str) -> None:
    assert sdist.name == f"gradsync-{version}.tar.gz", sdist.name
    root = f"gradsync-{version}"
    with tarfile.open(sdist) as tf:
        names = {n.removeprefix(f"{root}/") for n in tf.getnames()}
        member = tf.extractfile(f"{root}/PKG-INFO")
        assert member is not None
        check_metadata(member.read().decode(), repo, version)
    wanted = {
        "pyproject.toml",
        "setup.py",
        "README.md",
        "CHANGELOG.md",
        "src/_gradsync_autoinstall.py",
        "src/gradsync/py.typed",
    }
    wanted |= {f"src/{m}" for m in package_modules(repo)}
    missing = sorted(wanted - names)
    assert not missing, f"missing from the sdist: {missing}"


def check(dist: Path, repo: Path) -> str:
    """Check the one sdist and the one wheel in ``dist``; returns a line saying what was checked."""
    version = source_version(repo)
    sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, f"expected one sdist and one wheel in {dist}: {sdists + wheels}"
    check_sdist(sdists[0], repo, version)
    names = check_wheel(wheels[0], repo, version)
    return f"{sdists[0].name} and {wheels[0].name}: metadata valid, {len(names)} files in the wheel"
