"""Accelerate profiles: the launch configs in deployments/accelerate/ and how a run picks one.

The package finds them as its own data (`accelerate_profiles/`, a symlink to deployments/accelerate/ in a checkout,
real files in a wheel), so a run does not depend on where the repository or the worker's working directory is.
"""

from __future__ import annotations

from pathlib import Path

from rloo_engine.config_base import ConfigError

ACCELERATE_PROFILES = ("cpu", "single_gpu", "multi_gpu", "deepspeed_zero2", "deepspeed_zero3", "fsdp2")
PROFILE_ENV = "RLOO_ACCELERATE_PROFILE"  # set per work pool / deployment as a job variable
PROFILES_DIR = Path(__file__).resolve().parent / "accelerate_profiles"


def resolve_profile(profile: str | None, environ: dict[str, str], profiles_dir: Path = PROFILES_DIR) -> Path:
    """The accelerate YAML for `profile` (see LaunchSection.profile), checked to exist."""
    name = profile or environ.get(PROFILE_ENV)
    if not name:
        import torch

        name = "single_gpu" if torch.cuda.is_available() else "cpu"
    if name in ACCELERATE_PROFILES:
        path = profiles_dir / f"{name}.yaml"
    else:
        path = Path(name).expanduser()
    if not path.is_file():
        where = "launch.profile" if profile else f"${PROFILE_ENV}"
        raise ConfigError(
            f"{where}: {name!r} is neither one of {', '.join(ACCELERATE_PROFILES)} nor an existing accelerate YAML file"
        )
    return path.resolve()
