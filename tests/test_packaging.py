"""A wheel carries what an installed pipeline needs without the repository: the accelerate profiles, the judge
templates, the `py.typed` marker and the license, and no test file."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy of the tracked files: an in-tree build/ left by an earlier build would carry stale modules.
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in tracked.decode().split("\0"):
        if name and ((ROOT / name).exists() or (ROOT / name).is_symlink()):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name, follow_symlinks=False)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (path,) = out.glob("rloo_pipeline-*.whl")
    return path


def test_the_wheel_carries_the_profiles_and_templates(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    profiles = {Path(n).name for n in names if n.startswith("rloo_engine/pipeline/accelerate_profiles/")}
    assert profiles == {f.name for f in (ROOT / "deployments" / "accelerate").glob("*.yaml")}
    assert {"rloo_engine/evaluation/templates/tldr_v1.yaml", "rloo_engine/py.typed"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith("tests/") for n in names)
    # Only the library: top-level `flows` / `tasks` packages would shadow (or be shadowed by) a user's own modules.
    assert {n.split("/")[0] for n in names if "/" in n and not n.split("/")[0].endswith(".dist-info")} == {"rloo_engine"}


def test_the_engine_alone_requires_none_of_the_pipeline_packages(wheel):
    """`pip install rloo-pipeline` is the engine: MLflow, Prefect and the openai client come only with extras."""
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.removeprefix("Requires-Dist: ") for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    core = {r.split(">")[0].split("=")[0].split("<")[0].strip() for r in requires if "extra ==" not in r}
    assert {"torch", "transformers", "accelerate", "datasets", "peft", "safetensors", "pydantic"} <= core, core
    assert not core & {"mlflow", "prefect", "openai", "aiohttp", "matplotlib", "pandas", "psutil"}, core
    extras = {r.split("extra ==")[1].strip().strip('"') for r in requires if "extra ==" in r}
    assert {"mlflow", "openai", "pipeline", "dev"} <= extras, extras


def test_an_installed_copy_finds_its_profiles_without_the_repository(wheel, tmp_path):
    # The package alone, unpacked elsewhere as pip would install it, with no checkout on the path.
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path, [n for n in z.namelist() if n.startswith("rloo_engine/")])
    code = "import rloo_engine.pipeline.profiles as p; print(p.resolve_profile('deepspeed_zero3', {}))"
    proc = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {code}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    expected = tmp_path / "rloo_engine" / "pipeline" / "accelerate_profiles" / "deepspeed_zero3.yaml"
    assert proc.stdout.strip() == str(expected)
    assert not expected.is_symlink()
