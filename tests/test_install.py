"""The package installs under one import name, flt: every layer folder's subpackages are
listed for setuptools, and the installed names work from outside the repository."""

import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
REPO = Path(__file__).resolve().parents[1]
LAYERS = ("emulator", "devices", "server", "models", "scenarios", "common", "reports")


def test_every_subpackage_is_installed_under_flt():
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {f"flt.{layer}": layer for layer in LAYERS}
    on_disk = {
        "flt." + ".".join(init.parent.relative_to(REPO).parts)
        for layer in LAYERS
        for init in (REPO / layer).rglob("__init__.py")
    }
    assert set(setup["packages"]) == on_disk  # a new subpackage left out would be missing from the wheel


@pytest.mark.slow
def test_installed_names_import_outside_the_repository(tmp_path):
    code = (
        "import sys, flt.server.fcr, flt.devices.ops, flt.emulator.cli;"
        f"assert not {set(LAYERS)!r} & set(sys.modules), 'top-level name';"
        "print(flt.server.fcr.__name__)"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "flt.server.fcr"
    dev = subprocess.run(
        [sys.executable, "-m", "flt.devices", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert dev.returncode == 0 and "--connect" in dev.stdout, dev.stderr
