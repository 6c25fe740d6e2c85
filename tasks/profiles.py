"""Accelerate profiles: the launch configs in deployments/accelerate/ and how a run picks one."""

from __future__ import annotations

from pathlib import Path

from rloo_engine.config import ConfigError

ACCELERATE_PROFILES = ("cpu", "single_gpu", "multi_gpu", "deepspeed_zero2", "deepspeed_zero3")
PROFILE_ENV = "RLOO_ACCELERATE_PROFILE"  # set per work pool / deployment as a job variable


def resolve_profile(profile: str | None, repo_root: Path, environ: dict[str, str]) -> Path:
    """The accelerate YAML for `profile` (see LaunchSection.profile), checked to exist."""
    name = profile or environ.get(PROFILE_ENV)
    if not name:
        import torch

        name = "single_gpu" if torch.cuda.is_available() else "cpu"
    if name in ACCELERATE_PROFILES:
        path = repo_root / "deployments" / "accelerate" / f"{name}.yaml"
    else:
        path = Path(name).expanduser()
    if not path.is_file():
        where = "launch.profile" if profile else f"${PROFILE_ENV}"
        raise ConfigError(
            f"{where}: {name!r} is neither one of {', '.join(ACCELERATE_PROFILES)} nor an existing accelerate YAML file"
        )
    return path.resolve()
