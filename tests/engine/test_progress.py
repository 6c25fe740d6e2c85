"""Progress output off a terminal: a few throttled plain lines instead of redrawn bars."""

from __future__ import annotations

import io

from rloo_engine.progress import PlainProgress, progress_bar


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_tqdm_bar_and_a_file_gets_plain_lines():
    from tqdm.auto import tqdm

    assert isinstance(progress_bar(total=3, file=FakeTerminal()), tqdm)
    assert isinstance(progress_bar(total=3, file=io.StringIO()), PlainProgress)


def test_plain_progress_prints_a_line_per_tenth_and_a_final_line():
    out = io.StringIO()
    bar = progress_bar(range(1000), desc="demo assets: SFT policy", unit="step", file=out)
    for i in bar:
        bar.set_postfix(loss=f"{1 / (i + 1):.3f}")
    lines = out.getvalue().splitlines()
    assert len(lines) == 10, lines  # 10%, 20%, ..., 100%: the last one is also the final line
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("demo assets: SFT policy: 100/1000 step (10%), ")
    assert lines[-1].startswith("demo assets: SFT policy: 1000/1000 step (100%), ") and lines[-1].endswith("loss=0.001")


def test_plain_progress_also_prints_when_a_tenth_takes_longer_than_the_interval(monkeypatch):
    monkeypatch.setenv("RLOO_PROGRESS_INTERVAL", "0")
    out = io.StringIO()
    bar = progress_bar(total=1000, desc="slow", file=out)
    for _ in range(5):
        bar.update(1)
    bar.close()
    assert len(out.getvalue().splitlines()) == 5  # every update, since each took "longer than 0 s"; no repeat at close


def test_a_stopped_bar_ends_with_where_it_stopped_and_a_disabled_bar_prints_nothing():
    out = io.StringIO()
    bar = progress_bar(total=4, desc="demo assets", unit="stage", file=out)
    bar.update(1)
    bar.set_postfix_str("reward model")
    bar.close()
    bar.close()
    assert len(out.getvalue().splitlines()) == 1  # closing twice prints once
    assert out.getvalue().startswith("demo assets: 1/4 stage (25%), ")
    quiet = io.StringIO()
    with progress_bar(total=4, file=quiet, disable=True) as bar:
        bar.update(4)
    assert quiet.getvalue() == ""


def test_the_nested_demo_asset_bars_write_a_few_lines_to_a_log(tmp_path, capsys):
    """Captured to a file, the asset build (stages, SFT loop, reward-model loop) prints plain lines only."""
    import torch

    from rloo_engine.demo.assets import build_demo_assets

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        build_demo_assets(tmp_path / "assets", smoke=True)
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("demo assets")]
    assert "\r" not in err
    assert 3 <= len(lines) <= 40, err
    assert any(ln.startswith("demo assets: SFT policy: 40/40 step (100%)") for ln in lines), lines
    assert any(ln.startswith("demo assets: 4/4 stage (100%)") for ln in lines), lines


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_show_the_rate_and_the_time_left_as_tqdm_does(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("rloo_engine.progress.time.monotonic", clock)
    out = io.StringIO()
    slow = PlainProgress(total=30, desc="rloo", unit="step", stream=out)
    for _ in range(3):
        clock.now += 4.0
        slow.update(1)
    assert out.getvalue().splitlines() == ["rloo: 3/30 step (10%), 12 s, 4 s/step, ETA 1:48"]

    fast, resumed = io.StringIO(), io.StringIO()
    bar = PlainProgress(total=100, desc="fast", unit="step", stream=fast)
    clock.now += 4.0
    bar.update(10)
    assert fast.getvalue().splitlines() == ["fast: 10/100 step (10%), 4 s, 2.5 step/s, ETA 0:36"]
    # A resumed run's bar starts at its step: the rate counts only the steps done since then.
    bar = PlainProgress(total=5000, initial=4000, desc="resumed", unit="step", stream=resumed)
    clock.now += 2.0 * 3600
    bar.update(500)
    assert resumed.getvalue().splitlines() == ["resumed: 4500/5000 step (90%), 7200 s, 14.4 s/step, ETA 2:00:00"]
    bar.close()
    assert resumed.getvalue().splitlines()[-1] == "resumed: 4500/5000 step (90%), 7200 s, 14.4 s/step, ETA 2:00:00"


def test_a_metric_line_is_the_dict_trl_prints_with_small_values_in_scientific_notation():
    from rloo_engine.progress import metric_line

    line = metric_line({"loss": 0.012345678, "reward": 1.2, "kl": 3.2e-05, "num_tokens": 1536.0, "epoch": 0.1})
    assert line == "{'loss': 0.01235, 'reward': 1.2, 'kl': 3.2e-05, 'num_tokens': 1536, 'epoch': 0.1}"


def test_training_prints_a_metric_line_every_logging_steps_and_a_readable_kl(tmp_path, qwen2_model, capsys):
    from rloo_engine.trainer import RLOOTrainer
    from tests.engine.helpers import tiny_config

    cfg = tiny_config(tmp_path, qwen2_model, max_steps=4, logging_steps=2, beta=0.05, learning_rate=5e-2,
                      disable_tqdm=False, report_to="none")
    RLOOTrainer(cfg).train()
    err = capsys.readouterr().err
    metric_lines = [ln for ln in err.splitlines() if ln.startswith("{'")]
    assert len(metric_lines) == 2, err  # steps 2 and 4
    assert all("'reward': " in ln and "'kl': " in ln and "'epoch': " in ln for ln in metric_lines)
    assert "-0.000" not in err and "kl=0.000" not in err
    progress = [ln for ln in err.splitlines() if ln.startswith("rloo: ")]
    assert progress[-1].startswith("rloo: 4/4 step (100%), ")
    assert " step/s" in progress[-1] or " s/step" in progress[-1]
