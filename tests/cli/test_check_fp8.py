"""`jetrl check-fp8` prints the FP8-vs-BF16 report."""

from jetrl.cli import main


def test_check_fp8_prints_errors(capsys):
    assert main(["check-fp8", "--m", "64", "--n", "128", "--k", "256", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "rel. error output" in out and "reference" in out
    err = float(out.split("rel. error output")[1].split()[0])
    assert 1e-3 < err < 0.1
