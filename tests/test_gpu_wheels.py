"""bench/gpu_wheels.sh builds a wheel set that Python 3.12 (the GPU image's) installs offline, with nothing missing."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def python312() -> str | None:
    for candidate in ("python3.12", *sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))):
        found = shutil.which(str(candidate))
        if found and subprocess.run([found, "-c", "import venv"], capture_output=True).returncode == 0:
            return found
    return None


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("whl")
    proc = subprocess.run(["bash", "bench/gpu_wheels.sh", str(dest)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wheels," in proc.stdout
    return dest


def test_pip_accepts_the_set_for_python_312(wheels, tmp_path):
    # pip's own check of the tags against a 3.12 manylinux target, as the device's pip would do.
    names = ["pydantic", "pydantic-core", "datasets", "dill", "multiprocess", "hjson", "deepspeed", "trl"]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(wheels), "--no-deps",
         "--only-binary=:all:", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
         "--platform", "manylinux2014_x86_64", "--target", str(tmp_path / "t"), *names],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Would install" in proc.stdout and "deepspeed-" in proc.stdout and "trl-1.16.0" in proc.stdout


def test_a_python_312_interpreter_installs_and_imports_them(wheels, tmp_path):
    py = python312()
    if py is None:
        pytest.skip("no Python 3.12 interpreter on this machine; the dry-run test above checked the tags")
    subprocess.run([py, "-m", "venv", str(tmp_path / "v")], check=True, timeout=120)
    pip = [str(tmp_path / "v" / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    proc = subprocess.run(pip + sorted(str(w) for w in wheels.glob("*.whl")), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    code = "import pydantic, pydantic_core, hjson, dill, msgpack, xxhash, annotated_types, typing_inspection"
    proc = subprocess.run([str(tmp_path / "v" / "bin" / "python"), "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
