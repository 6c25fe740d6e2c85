"""The README and docs run as written: every command and config block is run here, validated by the real config
class, run by the test its marker names, or marked as not runnable in CI with the reason (tests/doc_blocks.py).

Runs use a fresh state directory, the installed commands (`.venv/bin` first on PATH, as an activated venv has it)
and real servers. Where a block names a machine CI does not have (PostgreSQL, S3, a hostname), SUBSTITUTIONS says
what stands in and why; each original text must still be in the block, so an edit of the docs cannot leave a
substitution silently unused.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.doc_blocks import REPO, DocBlock, checked_blocks, commands, run_blocks
from tests.services import Service, free_port, start_service, wait_until_ready

BIN = Path(sys.executable).parent
BLOCKS = checked_blocks()


def _ids(block: DocBlock) -> str:
    return block.where


def test_every_command_and_config_block_says_how_it_is_tested(capsys):
    unmarked = [b.where for b in BLOCKS if b.kind is None]
    assert not unmarked, (
        f"blocks without a `<!-- doc-test: ... -->` marker on the line above their fence: {unmarked}; "
        "tests/doc_blocks.py lists the kinds")
    counts = {kind: sum(b.kind == kind for b in BLOCKS) for kind in ("run", "config", "covered", "not-run")}
    not_run = [f"  {b.where}: {b.argument}" for b in BLOCKS if b.kind == "not-run"]
    with capsys.disabled():
        print(f"\ndoc blocks: {len(BLOCKS)} checked: {counts['run']} run here, {counts['config']} validated, "
              f"{counts['covered']} run by another test, {counts['not-run']} not runnable in CI:\n" + "\n".join(not_run))
    for block in BLOCKS:
        if block.kind == "run":
            assert block.argument in RUNNERS, f"{block.where}: no runner named {block.argument!r}"
        if block.kind == "not-run":
            assert len(block.argument.split()) >= 4, f"{block.where}: say why it cannot run in CI"


# ---------------------------------------------------------------- config blocks


def _merged(base: dict, fragment: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in fragment.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _validate_config(model: str, text: str, tmp_path: Path) -> None:
    from rloo_engine.config import RLOOConfig
    from rloo_engine.evaluation.config import EvalConfig
    from rloo_engine.evaluation.templates import load_template
    from rloo_engine.pipeline.config import PipelineConfig

    values = yaml.safe_load(text)
    if model == "engine":
        RLOOConfig.model_validate(values)
    elif model == "eval":
        EvalConfig.model_validate(values)
    elif model == "eval-fragment":  # a part of an EvalConfig: on top of configs/eval_example.yaml
        EvalConfig.model_validate(_merged(yaml.safe_load((REPO / "configs/eval_example.yaml").read_text()), values))
    elif model == "pipeline-fragment":  # a part of a pipeline config: on top of configs/pipeline_example.yaml
        base = yaml.safe_load((REPO / "configs/pipeline_example.yaml").read_text())
        PipelineConfig.model_validate(_merged(base, values))
    elif model == "template":
        path = tmp_path / "template.yaml"
        path.write_text(text)
        load_template(str(path))
    else:
        raise AssertionError(f"unknown config model {model!r}")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "config"], ids=_ids)
def test_config_block_is_valid(block, tmp_path):
    _validate_config(block.argument, block.text, tmp_path)


def test_a_config_block_with_a_wrong_value_fails_its_check(tmp_path):
    """The check can fail: the README's judge snippet as it read before issue 45 (`template: tldr_v1`) is refused."""
    snippet = "evaluation:\n  judge:\n    backend: openai\n    model: gpt-4o\n    template: tldr_v1\n"
    with pytest.raises(ValueError, match="tldr_v1"):
        _validate_config("pipeline-fragment", snippet, tmp_path)


# ---------------------------------------------------------------- blocks another test runs


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "covered"], ids=_ids)
def test_covered_block_is_run_by_the_named_test(block):
    for item in block.argument.split():
        path, _, token = item.partition(":")
        assert (REPO / path).is_file(), f"{block.where}: {path} does not exist"
        assert token and token in (REPO / path).read_text(), f"{block.where}: {path} does not contain {token!r}"


# ---------------------------------------------------------------- blocks run here


class ShellSession:
    """Runs a shell block's commands one by one, as a user at a terminal would: `export` and `cd` carry over,
    servers and workers (which never exit) run in the background until the session ends, the rest must exit 0."""

    SERVERS = ("mlflow server", "prefect server start", "prefect worker start")

    def __init__(self, root: Path):
        self.root = root
        self.cwd = REPO
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "RLOO_"))}
        self.env = {**inherited, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PREFECT_HOME": str(root / "home"),
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                    "DO_NOT_TRACK": "1", "COLUMNS": "400"}  # Prefect's tables cut names to the terminal's width
        self.env.pop("PYTHONPATH", None)  # a user's shell has no checkout on the path: the install must suffice
        self.services: list[Service] = []
        self.transcript: list[str] = []

    def run(self, command: str, timeout: float = 300) -> subprocess.CompletedProcess | None:
        self.transcript.append(f"$ {command}")
        words = shlex.split(command)
        if words[0] == "export":
            for assignment in words[1:]:
                name, _, value = assignment.partition("=")
                self.env[name] = self._expand(value)
            return None
        if words[0] == "cd":
            self.cwd = Path(self._expand(words[1]))
            return None
        if any(command.startswith(server) for server in self.SERVERS):
            self._start(command, words)
            return None
        proc = subprocess.run(["bash", "-c", command], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        self.transcript.append(proc.stdout[-2000:] + proc.stderr[-2000:])
        assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n" + "\n".join(self.transcript[-12:])
        return proc

    def _expand(self, value: str) -> str:
        """`$NAME` / `${NAME}` from this session's environment; `$PWD` is the session's directory."""
        def lookup(match: re.Match) -> str:
            name = match.group(1) or match.group(2)
            return str(self.cwd) if name == "PWD" else self.env.get(name, "")

        return re.sub(r"\$(\w+)|\$\{(\w+)\}", lookup, value)

    def _start(self, command: str, words: list[str]) -> None:
        name = f"{words[0]}-{words[1]}-{len(self.services)}"
        service = start_service(name, ["bash", "-c", f"exec {command}"], self.env, self.root, cwd=self.cwd)
        self.services.append(service)
        port = words[words.index("--port") + 1] if "--port" in words else None
        if words[:2] == ["mlflow", "server"]:
            wait_until_ready(service, f"http://127.0.0.1:{port}/health", timeout=180)
        elif words[:3] == ["prefect", "server", "start"]:
            wait_until_ready(service, f"http://127.0.0.1:{port}/api/health", timeout=180)
        else:  # a worker: up when it says so
            deadline = time.monotonic() + 120
            while "started!" not in service.log_tail(200):
                assert service.proc.poll() is None and time.monotonic() < deadline, service.log_tail()
                time.sleep(0.5)

    def close(self) -> None:
        for service in reversed(self.services):
            service.stop()


def _substituted(blocks: list[DocBlock], substitutions: list[tuple[str, str, str]], values: dict[str, str]) -> str:
    text = "".join(b.text for b in blocks)
    for old, new, why in substitutions:
        assert old in text, f"substitution {old!r} ({why}) no longer matches the block: update SUBSTITUTIONS"
        text = text.replace(old, new.format(**values))
    return text


# What stands in, in CI, for what the production blocks name, and why.
PRODUCTION_SUBSTITUTIONS = [
    ("postgresql://mlflow@db/mlflow", "sqlite:///{root}/mlflow.db", "no PostgreSQL in CI: MLflow's SQLite store"),
    ("s3://bucket/mlflow", "{root}/mlartifacts", "no S3 in CI: a local artifacts destination"),
    ("--host 0.0.0.0 --port 5000", "--host 127.0.0.1 --port {mlflow_port}", "loopback, a free port"),
    ("prefect server start --host 0.0.0.0", "prefect server start --host 127.0.0.1 --port {prefect_port}",
     "loopback, a free port"),
    ("http://prefect.internal:4200", "http://127.0.0.1:{prefect_port}", "the server started above"),
    ("http://mlflow.internal:5000", "http://127.0.0.1:{mlflow_port}", "the server started above"),
    ("/opt/rloo-pipeline", "{repo}", "the checkout under test"),
]


def _set_up_and_deploy(name: str, substitutions: list[tuple[str, str, str]], root: Path) -> None:
    """Runs the blocks marked `run NAME` as one shell session on free loopback ports, then checks what they deployed."""
    values = {"root": str(root), "repo": str(REPO), "mlflow_port": str(free_port()), "prefect_port": str(free_port())}
    session = ShellSession(root)
    try:
        for command in commands(_substituted(run_blocks(name), substitutions, values)):
            session.run(command)
        _assert_deployed(session)
    finally:
        session.close()


def _assert_deployed(session: ShellSession) -> None:
    """Every deployment of deployments/prefect.yaml is on the server, each pool exists, the automations too."""
    spec = yaml.safe_load((REPO / "deployments/prefect.yaml").read_text())
    for pool in {d["work_pool"]["name"] for d in spec["deployments"]}:
        session.run(f"prefect work-pool inspect {pool}")
    listed = session.run("prefect deployment ls").stdout
    for deployment in spec["deployments"]:
        assert deployment["name"] in listed, listed
    automations = yaml.safe_load((REPO / "deployments/automations/rerun-crashed-flow-runs.yaml").read_text())
    names = [a["name"] for a in automations["automations"]]
    listed = session.run("prefect automation ls").stdout
    assert all(name in listed for name in names), listed


@pytest.mark.slow
def test_readme_production_deployment_runs_as_written(tmp_path):
    """README "Production deployment": MLflow and Prefect servers, both work pools, a worker, every deployment and
    the automations, on a fresh state directory (before issue 45 step 4 exited 1: pool `train-nodes` missing)."""
    _set_up_and_deploy("production-setup", PRODUCTION_SUBSTITUTIONS, tmp_path)


@pytest.mark.slow
def test_pipeline_doc_set_up_runs_as_written(tmp_path):
    """docs/pipeline.md's set-up blocks in order: MLflow server, Prefect server, pools, worker, deploy."""
    substitutions = [
        ("postgresql://mlflow:***@db.internal:5432/mlflow", "sqlite:///{root}/mlflow.db",
         "no PostgreSQL in CI: MLflow's SQLite store"),
        ("s3://ml-artifacts/mlflow", "{root}/mlartifacts", "no S3 in CI: a local artifacts destination"),
        ("--host 0.0.0.0 --port 5000 --allowed-hosts mlflow.internal,10.0.0.*",
         "--host 127.0.0.1 --port {mlflow_port} --allowed-hosts mlflow.internal,10.0.0.*,127.0.0.1:*",
         "loopback, a free port; the test's client is on 127.0.0.1"),
        ("postgresql+asyncpg://prefect:***@db.internal:5432/prefect", "sqlite+aiosqlite:///{root}/prefect.db",
         "no PostgreSQL in CI: Prefect's SQLite store"),
        ("--host 0.0.0.0 --port 4200", "--host 127.0.0.1 --port {prefect_port}", "loopback, a free port"),
        ("http://prefect.internal:4200", "http://127.0.0.1:{prefect_port}", "the server started above"),
        ("http://mlflow.internal:5000", "http://127.0.0.1:{mlflow_port}", "the server started above"),
        ("/opt/rloo-pipeline", "{repo}", "the checkout under test"),
    ]
    _set_up_and_deploy("pipeline-setup", substitutions, tmp_path)


def test_readme_engine_commands_run_as_written(tmp_path):
    """README "The training engine on its own": `rloo-engine --help` lists the commands the README names, and the
    train line runs on tiny assets (`--max_steps 2` for the README's 1000: CPU time)."""
    (block,) = run_blocks("engine-cli")
    help_line, train_line = commands(block.text)
    named = re.search(r"\(([^)]*)\)", block.text.splitlines()[0]).group(1)
    session = ShellSession(tmp_path)
    session.cwd = tmp_path
    listed = re.findall(r"^  (\S+)  ", session.run(help_line).stdout, flags=re.M)
    assert [c.strip() for c in named.split(",")] == listed, (named, listed)
    session.run(f"rloo-engine tiny-assets {tmp_path}/assets")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({
        "model_name_or_path": str(tmp_path / "assets/policy"), "dataset_name": str(tmp_path / "assets/prompts.jsonl"),
        "reward_funcs": ["rloo_engine.reward_functions:char_fraction"], "num_generations": 2,
        "per_device_train_batch_size": 2, "max_completion_length": 4, "report_to": "none", "disable_tqdm": True}))
    assert "--max_steps 1000" in train_line
    proc = session.run(train_line.replace("--max_steps 1000", "--max_steps 2"))
    assert "rloo-engine: trained 2 steps" in proc.stdout, proc.stdout


RUNNERS = {
    "production-setup": test_readme_production_deployment_runs_as_written,
    "pipeline-setup": test_pipeline_doc_set_up_runs_as_written,
    "engine-cli": test_readme_engine_commands_run_as_written,
}
