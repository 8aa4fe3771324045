"""Run summaries from a metrics log: start and end means, the last mismatch, the time in steps."""

import json

import pytest

from jetrl.plotting import summarize_run


def test_summarize_run_means_first_and_last_steps(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 9):  # 8 steps: means over the first 2 and the last 2
            f.write(json.dumps({"step": step, "reward/mean": step / 10, "response/length_mean": 10.0 * step,
                                "mismatch/logp_abs_diff_mean": 1e-3, "time/step_wall": 1.5}) + "\n")
    rows = dict(summarize_run(tmp_path))
    assert rows["steps"] == "8"
    assert rows["reward (first 2 -> last 2 steps)"] == "0.150 -> 0.750"
    assert rows["response length (first 2 -> last 2 steps)"] == "15.000 -> 75.000"
    assert rows["accuracy (first 2 -> last 2 steps)"] == "nan -> nan"  # not logged
    assert rows["mismatch |Δ logp| mean (last)"] == "1.00e-03"
    assert rows["time in steps"] == "12 s"


def test_summarize_run_needs_a_log(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics"):
        summarize_run(tmp_path)


def _run(folder, steps: int):
    folder.mkdir()
    with open(folder / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "reward/mean": step / 10, "response/length_mean": 10.0,
                                "mismatch/logp_abs_diff_mean": 1e-3}) + "\n")
    return folder


def test_short_runs_have_whole_step_ticks(tmp_path):
    """A 3-step run's x axis shows steps 1, 2, 3, not 1.25, 1.50, 1.75."""
    import matplotlib.pyplot as plt

    from jetrl.plotting import draw_runs

    fig = draw_runs([_run(tmp_path / "short", 3)])
    try:
        for ax in fig.axes:
            low, high = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if low <= t <= high]
            assert ticks and all(t == int(t) for t in ticks), ticks
    finally:
        plt.close(fig)


def test_jetrl_plot_says_when_it_replaces_a_file(tmp_path, capsys):
    """`jetrl plot RUN` writes RUN/curves.png, the plot jetrl train wrote there: the output says it replaced it."""
    from jetrl.cli import main

    run = _run(tmp_path / "run", 3)
    assert main(["plot", str(run)]) == 0
    first = capsys.readouterr()
    assert first.out.strip() == str(run / "curves.png") and "replaced" not in first.err
    assert main(["plot", str(run)]) == 0
    assert f"jetrl plot: replaced the existing {run / 'curves.png'}" in capsys.readouterr().err


def test_jetrl_plot_names_the_file_it_wrote_and_the_run_it_plotted(tmp_path, capsys, monkeypatch):
    """``-o NAME`` without a suffix writes NAME.png, and that is the path printed; a run given as ``.`` (or its
    metrics file by bare name) is labelled by its folder's name, not an empty one; ``~`` is the home folder."""
    from jetrl.cli import main
    from jetrl.plotting import load_run

    run = _run(tmp_path / "myrun", 3)
    monkeypatch.chdir(run)
    assert load_run(".").label.startswith("myrun") and load_run("metrics.jsonl").label.startswith("myrun")
    assert main(["plot", ".", "-o", str(tmp_path / "out" / "plotout")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out" / "plotout.png")
    assert (tmp_path / "out" / "plotout.png").is_file()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert main(["plot", ".", "-o", "~/figs/c.png"]) == 0
    assert (tmp_path / "home" / "figs" / "c.png").is_file()


def test_runs_in_folders_of_the_same_name_are_told_apart(tmp_path):
    """``runs/a/seed0`` and ``runs/b/seed0`` get the legend labels ``a/seed0`` and ``b/seed0`` and the default file
    ``curves_a-seed0_vs_b-seed0.png`` (were: ``seed0`` twice, ``curves_seed0_vs_seed0.png``)."""
    from jetrl.plotting import default_plot_path, draw_runs

    for parent in ("a", "b"):
        (tmp_path / parent).mkdir()
    pairs = [_run(tmp_path / parent / "seed0", 3) for parent in ("a", "b")]
    fig = draw_runs(pairs)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a/seed0", "b/seed0"]
    assert default_plot_path(pairs).name == "curves_a-seed0_vs_b-seed0.png"
    import matplotlib.pyplot as plt

    plt.close(fig)
