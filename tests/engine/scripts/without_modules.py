"""Runs `python -m MODULE ARGS...` as if the named top-level packages were not installed: the engine-only install
(`pip install rloo-pipeline`, without the pipeline's MLflow, Prefect, openai, aiohttp, matplotlib), checked inside
the dev venv. scripts/test_engine_install.sh checks a real install of the bare engine once in CI.

    python without_modules.py mlflow,prefect,openai -- -m rloo_engine train ...
"""

import importlib.machinery
import runpy
import sys


class _PathFinderWithout(importlib.machinery.PathFinder):
    """sys.meta_path's PathFinder, blind to the named packages: `importlib.util.find_spec` answers None for them
    (what transformers' availability checks ask), importing them fails and their metadata is not found, as on a
    machine without them."""

    names: set[str] = set()

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.split(".")[0] in cls.names:
            return None
        return super().find_spec(fullname, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        return (d for d in super().find_distributions(*args, **kwargs) if d.metadata["Name"] not in cls.names)


if __name__ == "__main__":
    names, sep, module, *args = sys.argv[1:]
    assert sep == "--" and module == "-m", "usage: without_modules.py a,b,c -- -m module args..."
    _PathFinderWithout.names = set(names.split(","))
    sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = _PathFinderWithout
    sys.argv = [args[0], *args[1:]]
    runpy.run_module(args[0], run_name="__main__", alter_sys=True)
