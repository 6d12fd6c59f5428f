import io

from tqdm import tqdm

from keyplane.util.progressbars import LOG_INTERVAL_S, LogLineBar, progress_bar


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_bar_prints_plain_lines_and_its_last_state_fake_stream() -> None:
    log = io.StringIO()
    with progress_bar(file=log, total=300, desc="produce", unit="ev", mininterval=0) as bar:
        for _ in range(3):
            bar.update(100)
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert all(line.startswith("produce:") for line in lines), lines
    assert "  0%" in lines[0]
    assert "100%" in lines[-1] and "300/300" in lines[-1]
    assert text.endswith("\n")


def test_off_a_terminal_messages_are_not_followed_by_a_redrawn_bar_fake_stream() -> None:
    log = io.StringIO()
    with progress_bar(file=log, total=2, desc="produce", mininterval=0) as bar:
        tqdm.write("first message", file=log)
        bar.update(1)
        tqdm.write("second message", file=log)
    lines = log.getvalue().splitlines()
    assert len(lines) == 5, lines
    assert lines[1] == "first message" and lines[3] == "second message"
    assert "\r" not in log.getvalue()


def test_off_a_terminal_updates_print_at_most_every_log_interval_fake_stream() -> None:
    log = io.StringIO()
    with progress_bar(file=log, total=1000, desc="produce") as bar:
        assert bar.mininterval == LOG_INTERVAL_S
        for _ in range(1000):
            bar.update(1)
    # The first line, then the closing one: a thousand quick updates print nothing.
    assert len(log.getvalue().splitlines()) == 2


def test_in_a_terminal_the_bar_is_tqdm_redrawing_in_place_fake_terminal() -> None:
    terminal = FakeTerminal()
    with progress_bar(file=terminal, total=2, desc="produce", mininterval=0) as bar:
        bar.update(2)
    assert not isinstance(bar, LogLineBar)
    assert "\r" in terminal.getvalue()
