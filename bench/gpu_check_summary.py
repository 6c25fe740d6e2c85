"""bench/gpu_check.sh's summary: one JSON object naming every part, with its exit or why it did not run, its checks
and its numbers. Exit status 1 unless every part that ran passed its checks.

A training part passes only when it really updated the model: every step's `grad_norm` > 0, at every step some
prompt's completions got different rewards (`frac_reward_zero_std` < 1), step 1's KL to the reference is 0 (the
policy is the reference then; STEP1_KL_TOLERANCE allows float rounding between a decoding pass and a forward), and
the saved weights differ from the initial ones. A broken bf16 or ZeRO-3 update would fail one of these.

    python bench/gpu_check_summary.py MODE OUT WORK ELAPSED_S name=exit=why ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors import safe_open

TRAIN_PARTS = ("train_single", "train_zero3", "train_fsdp2")
EXPECTED_STEPS = 4
STEP1_KL_TOLERANCE = 1e-3


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def weights_change(before: Path, after: Path) -> float:
    """The largest absolute change of any weight between two save_pretrained directories (read tensor by tensor).
    The initial weights are first rounded to the saved dtype (ZeRO-3 in bf16 saves bf16), so rounding alone is no
    change."""
    def tensors(directory: Path) -> dict[str, tuple[Path, str]]:
        found = {}
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                found.update({key: (file, key) for key in f.keys()})
        return found

    old, new = tensors(before), tensors(after)
    assert old and set(old) == set(new), f"{after}: weights {sorted(set(old) ^ set(new))[:5]} differ in name"
    largest = 0.0
    for key, (file, _) in old.items():
        with safe_open(file, "pt") as a, safe_open(new[key][0], "pt") as b:
            saved = b.get_tensor(key)
            largest = max(largest, float((a.get_tensor(key).to(saved.dtype).float() - saved.float()).abs().max()))
    return largest


def train_part(run_dir: Path, initial: Path) -> dict:
    steps = rows(run_dir / "metrics.jsonl")
    part: dict = {"steps": len(steps)}
    if steps:
        timed = steps[1:] or steps  # step 1 includes warm-up
        seconds = sum(r["step_time"] for r in timed)
        part.update(s_per_step=round(seconds / len(timed), 3),
                    tokens_per_s=round(sum(r["num_tokens"] for r in timed) / seconds, 1),
                    reward=[r.get("reward") for r in steps], grad_norm=[r.get("grad_norm") for r in steps],
                    frac_reward_zero_std=[r.get("frac_reward_zero_std") for r in steps], step1_kl=steps[0].get("kl"))
        peak = [r["memory/max_allocated_gib"] for r in steps if "memory/max_allocated_gib" in r]
        if peak:
            part["peak_gpu_gib"] = max(peak)
    failed = []
    if len(steps) != EXPECTED_STEPS:
        failed.append(f"{len(steps)} steps logged, {EXPECTED_STEPS} expected")
    if any(not (r.get("grad_norm") or 0) > 0 for r in steps):
        failed.append("grad_norm 0 (or missing) at some step: no update")
    if any(r.get("frac_reward_zero_std", 1) >= 1 for r in steps):
        failed.append("every group's rewards tied at some step: every advantage 0")
    if steps and abs(steps[0].get("kl", float("nan"))) > STEP1_KL_TOLERANCE:
        failed.append(f"step-1 kl {steps[0].get('kl')} (the policy is the reference at step 1: 0 expected)")
    if (run_dir / "final").is_dir():
        part["max_weight_change"] = weights_change(initial, run_dir / "final")
        if not part["max_weight_change"] > 0:
            failed.append("final/ weights equal the initial ones")
    else:
        failed.append("no final/ written")
    if failed:
        part["failed_checks"] = failed
    return part


def main(mode: str, out: Path, work: Path, elapsed: int, items: list[str]) -> int:
    result = {"gpu_check": "ok", "mode": mode, "elapsed_s": elapsed, "parts": {}}
    for item in items:
        name, rc, why = item.split("=", 2)
        part: dict = {"not_run": why} if rc == "not_run" else {"exit": int(rc)}
        if name == "imports":
            notes = [ln.removeprefix("RANGE: ") for ln in (out / "setup.log").read_text().splitlines()
                     if ln.startswith("RANGE: ")]
            if notes:
                part["outside_supported_range"] = notes[0]
        if name == "grad":
            lines = (out / "grad.log").read_text().splitlines() if (out / "grad.log").is_file() else []
            part["variants"] = {r.pop("variant"): r for r in map(json.loads, (ln for ln in lines if ln.startswith("{")))}
        if name in TRAIN_PARTS and rc == "0":
            part.update(train_part(work / name, work / "assets" / "policy"))
        if name == "throughput" and rc == "0":
            data = json.loads((work / "throughput.json").read_text())
            s = data["summary"]
            part.update(s_per_step=round(s["step_time_s"], 3), tokens_per_s=round(s["tokens_per_s_end_to_end"], 1))
            if isinstance(data.get("peak_flop_per_s"), (int, float)) and data["peak_flop_per_s"]:
                part["fraction_of_matmul_peak"] = round(s["achieved_flop_per_s"] / data["peak_flop_per_s"], 3)
        if name == "vs_trl" and rc == "0":  # gpu_vs_trl.py's last line is its JSON result
            data = json.loads((out / "vs_trl.log").read_text().strip().splitlines()[-1])
            part.update({k: round(v, 3) for k, v in data.items()
                         if k in ("speedup", "rss_ratio", "engine_s_per_step", "trl_s_per_step")}, vllm=data["vllm"])
        result["parts"][name] = part
        if part.get("exit", 0) != 0 or part.get("failed_checks"):
            result["gpu_check"] = "failed"
        elif "budget" in part.get("not_run", "") and result["gpu_check"] == "ok":
            result["gpu_check"] = "incomplete"
    print(json.dumps(result, sort_keys=True))
    return 0 if result["gpu_check"] == "ok" else 1


if __name__ == "__main__":
    mode, out, work, elapsed, *items = sys.argv[1:]
    sys.exit(main(mode, Path(out), Path(work), int(elapsed), items))
