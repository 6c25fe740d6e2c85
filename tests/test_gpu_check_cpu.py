"""bench/gpu_check.sh --cpu runs the GPU check's every part end to end on CPU with a tiny model, so the script that
must work the first time a GPU is lent cannot rot: it exits 0 and its last line is the JSON summary."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work")}
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["gpu_check"] == "ok" and summary["mode"] == "cpu"
    assert set(summary["parts"]) == {"imports", "model", "train_single", "train_zero3", "throughput"}
    for name in ("train_single", "train_zero3"):
        assert summary["parts"][name]["steps"] == 6, summary["parts"][name]
        assert summary["parts"][name]["tokens_per_s"] > 0
    assert summary["parts"]["throughput"]["s_per_step"] > 0
    assert summary["elapsed_s"] < 480
    # Only small files come back from a device run: at most 8, none of them a model.
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(files) <= 8, files
    assert all((tmp_path / "out" / f).stat().st_size < 2**20 for f in files), files
