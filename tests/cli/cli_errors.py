"""How the CLI tests read a refused command: ``jetrl: error:``'s one line, or argparse's usage error."""

import pytest

from jetrl.cli import main


def error_line(capsys, argv, status: int = 2) -> str:
    """The one ``jetrl: error:`` line of ``main(argv)``, which must return ``status`` with no traceback."""
    assert main(argv) == status
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("jetrl: error:")]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def parser_error(capsys, argv) -> str:
    """argparse's stderr for ``main(argv)``, which must exit with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err
