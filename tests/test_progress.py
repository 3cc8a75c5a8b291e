"""ps-demo's progress (``paramserver.cli.progress``): tqdm's bar on a terminal, plain rate-limited lines in a log."""

import io

from paramserver.cli.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_that_moves_with_every_update():
    screen = Terminal()
    progress = Progress(50, "ps-demo", screen)
    for done in (1, 2, 3):
        progress.update(done, {"loss": "0.5"})
    progress.close()
    drawn = screen.getvalue()
    assert all(f" {done}/50 " in drawn for done in (1, 2, 3)) and "loss 0.5" in drawn and "\r" in drawn, drawn


def test_a_log_gets_plain_lines_at_most_every_interval_and_at_the_end():
    log = io.StringIO()
    progress = Progress(50, "ps-demo", log, every=3600)
    for done in range(1, 50):
        progress.update(done, {"loss": "0.5"})
    progress.update(50, {"loss": "0.25"}, force=True)
    progress.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in log.getvalue() and "\033" not in log.getvalue(), lines
    assert lines[0].startswith("ps-demo:") and " 1/50 " in lines[0] and "loss 0.5" in lines[0], lines
    assert " 50/50 " in lines[1] and "loss 0.25" in lines[1], lines
