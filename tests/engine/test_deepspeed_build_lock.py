"""A compile of DeepSpeed's CPU communication op killed part-way leaves torch's build lock behind, and every later
DeepSpeed run on CPU then waited on it forever, silently (issue 46). The engine removes a lock no compile holds,
saying so, and names one a compile may still hold. The op itself is compiled once by scripts/setup.sh; these tests
copy that build into their own TORCH_EXTENSIONS_DIR, so nothing compiles here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rloo_engine.testing.tiny_models import write_prompt_file
from rloo_engine.torch_extensions import SHM_COMM_OP, clear_stale_lock, cpu_build_dir
from tests.engine.helpers import repo_pythonpath

pytest.importorskip("deepspeed", reason="DeepSpeed is the `deepspeed` extra; scripts/setup.sh installs it")
REPO = Path(__file__).resolve().parents[2]
LOAD_OP = ("from deepspeed.accelerator import get_accelerator; "
           "get_accelerator().create_op_builder('ShareMemCommBuilder').load(verbose=False); print('loaded')")


@pytest.fixture
def extensions_dir(tmp_path, monkeypatch) -> Path:
    """A TORCH_EXTENSIONS_DIR holding the op scripts/setup.sh built, and a lock left by a compile killed an hour ago."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    built = cpu_build_dir(SHM_COMM_OP)
    assert (built / f"{SHM_COMM_OP}.so").is_file(), f"{built}: scripts/setup.sh compiles DeepSpeed's CPU op there"
    root = tmp_path / "torch_extensions"
    shutil.copytree(built, root / SHM_COMM_OP, ignore=shutil.ignore_patterns("lock"))
    lock = root / SHM_COMM_OP / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return root


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "DS_ACCELERATOR": "cpu", "PYTHONPATH": repo_pythonpath()}


def test_a_stale_lock_makes_deepspeed_wait_and_is_removed(extensions_dir):
    # Without the engine's check, loading the op waits on the dead compile's lock until killed.
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", LOAD_OP], env=_env(extensions_dir), capture_output=True, timeout=20)
    said = []
    assert clear_stale_lock(say=said.append) == "removed"
    assert not (extensions_dir / SHM_COMM_OP / "lock").exists()
    assert "was killed part-way" in said[0] and str(extensions_dir / SHM_COMM_OP / "lock") in said[0]
    proc = subprocess.run([sys.executable, "-c", LOAD_OP], env=_env(extensions_dir), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-2000:]


def test_a_lock_a_compile_may_hold_is_named_and_kept(extensions_dir):
    lock = extensions_dir / SHM_COMM_OP / "lock"
    os.utime(lock)  # taken a moment ago: its compile may be starting
    said = []
    assert clear_stale_lock(say=said.append) == "held"
    assert lock.exists() and "delete that file" in said[0]
    # a process working in the build directory (as ninja does) holds an old lock too
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    worker = subprocess.Popen(["sleep", "30"], cwd=lock.parent)
    try:
        assert clear_stale_lock(say=said.append) == "held" and lock.exists()
        assert "a compile is running there" in said[-1]
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.slow
def test_a_deepspeed_run_after_a_killed_compile_trains(extensions_dir, tmp_path, qwen2_model):
    """The engine under a ZeRO-2 launch clears the lock itself before DeepSpeed starts, and trains."""
    data = write_prompt_file(tmp_path / "prompts.jsonl", num_prompts=8)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "deployments/accelerate/deepspeed_zero2.yaml"), "--num_processes", "1", "-m", "rloo_engine",
           "train", "--model_name_or_path", str(qwen2_model), "--dataset_name", str(data),
           "--reward_funcs", "rloo_engine.reward_functions:char_fraction", "--num_generations", "2",
           "--per_device_train_batch_size", "2", "--max_completion_length", "4", "--max_steps", "1",
           "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--disable_tqdm"]
    proc = subprocess.run(cmd, env={**_env(extensions_dir), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "was killed part-way" in proc.stderr and (tmp_path / "out" / "final").is_dir()
