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
