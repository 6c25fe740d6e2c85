"""The lock of a torch JIT extension build (DeepSpeed's CPU communication op, `deepspeed_shm_comm`).

DeepSpeed on CPU compiles that op on first use through torch's `cpp_extension.load` (minutes on a loaded core), and
every process that loads it takes the build directory's `lock` file first, even when the op is already built. A
compile killed part-way (a timeout, Ctrl-C, an OOM kill) leaves the lock behind, and every later DeepSpeed run on CPU
then waits on it forever without a word (torch's `FileBaton.wait`). `clear_stale_lock` runs before DeepSpeed starts:
a lock that no running compile holds is removed, with a line saying so; one that a compile may still hold is named,
so a long wait is explained. `scripts/setup.sh` compiles the op once, so runs and CI do not pay for it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

SHM_COMM_OP = "deepspeed_shm_comm"
# A compile's lock is taken a moment before its compiler processes start; younger locks are left alone.
YOUNGEST_STALE_LOCK_S = 30.0


def cpu_build_dir(name: str) -> Path:
    """Where torch builds CPU extension `name`: `$TORCH_EXTENSIONS_DIR/<name>`, else
    `~/.cache/torch_extensions/py<ver>_cpu/<name>` (torch's `_get_build_directory`)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / name
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / name


def build_shm_comm_op() -> None:
    """Compiles DeepSpeed's CPU communication op now (scripts/setup.sh), so no training run waits for it; seconds
    when it is already built."""
    clear_stale_lock()
    from deepspeed.accelerator import get_accelerator

    get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)


def compile_running(build_dir: Path) -> bool | None:
    """Whether a process works in `build_dir` (ninja and the compiler run there); None where /proc cannot tell."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    target = str(build_dir.resolve())
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(entry / "cwd") == target or target in (entry / "cmdline").read_bytes().decode(errors="replace"):
                return True
        except OSError:  # gone, or not ours to read
            continue
    return False


def clear_stale_lock(name: str = SHM_COMM_OP, say: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
                     now: float | None = None) -> str | None:
    """Removes `name`'s build lock when no compile holds it. Returns "removed", "held" (named, left alone) or None."""
    lock = cpu_build_dir(name) / "lock"
    try:
        seen = lock.stat()
    except FileNotFoundError:
        return None
    age = (time.time() if now is None else now) - seen.st_mtime
    running = compile_running(lock.parent)
    if age < YOUNGEST_STALE_LOCK_S or running is not False:
        say(f"rloo-engine: {lock} is {age:.0f} s old and "
            f"{'a compile is running there' if running else 'may belong to a compile still starting'}: DeepSpeed "
            f"waits for it; if nothing is compiling {name}, delete that file")
        return "held"
    try:
        if lock.stat().st_ino != seen.st_ino:  # another rank removed it and a compile took a new one meanwhile
            return "held"
        lock.unlink()
    except FileNotFoundError:  # another rank removed it first
        return None
    say(f"rloo-engine: removed {lock}, {age:.0f} s old with no compile running: a compile of DeepSpeed's {name} op "
        "was killed part-way and its lock would have made this run wait forever; the op is compiled again if needed")
    return "removed"
