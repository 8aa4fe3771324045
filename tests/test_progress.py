"""The one progress bar: counts and latest values on stderr, nothing at all when disabled."""

import pytest

from jetrl.progress import Progress


def test_enabled_bar_writes_counts_and_values_to_stderr(capsys):
    with Progress(4, "train", unit="step") as bar:
        bar.update()
        bar.update(2)
        bar.set_postfix(reward="0.500", len="12")
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\n")  # closed: the line is finished
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert final.startswith("train") and "3/4" in final and "step" in final
    assert "reward=0.500" in final and "len=12" in final


def test_disabled_bar_prints_nothing(capsys):
    with Progress(3, "eval", unit="prompt", enabled=False) as bar:
        bar.update(3)
        bar.set_postfix(acc="1.000")
    bar.close()  # closing twice is harmless
    assert capsys.readouterr() == ("", "")


def test_unknown_total_and_close_on_error(capsys):
    with pytest.raises(RuntimeError):
        with Progress(None, "rollout", unit="tok") as bar:
            bar.update(5)
            raise RuntimeError("stop")
    err = capsys.readouterr().err
    assert "rollout" in err and "5" in err and err.endswith("\n")
    with pytest.raises(ValueError, match="total must be >= 0"):
        Progress(-1, "x")
