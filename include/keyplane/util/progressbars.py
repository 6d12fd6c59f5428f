"""Progress bars that suit where the output goes: a terminal or a log file.

In a terminal tqdm redraws its bar in place, with a carriage return before
each redraw. Piped into a file, as CI logs and ``make demo > demo.log`` are,
every redraw is appended to the same line, so one bar becomes a line of
hundreds of carriage-return updates that a log viewer shows as one garbled
line. Off a terminal, :func:`progress_bar` prints a plain line every
:data:`LOG_INTERVAL_S` seconds instead, and a last one when the bar closes.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm

LOG_INTERVAL_S = 10.0
"""How often a bar off a terminal prints a line: a few lines a minute."""


class LogLineBar(tqdm):
    """A tqdm bar that prints whole lines and never draws in place."""

    def display(self, msg: str | None = None, pos: int | None = None) -> None:
        # msg == "" is tqdm clearing the bar it drew in place; a log has
        # nothing to clear (and a falsy return keeps close() from adding "\r").
        if msg != "":
            self.fp.write(f"{self if msg is None else msg}\n")
            self.fp.flush()

    def clear(self, nolock: bool = False) -> None:
        """Nothing was drawn in place, so ``tqdm.write`` has nothing to clear."""

    def refresh(self, nolock: bool = False, lock_args: Any = None) -> None:
        # tqdm.write redraws every open bar after its line (with nolock=True);
        # in a log that would repeat the bar after every message.
        if not nolock:
            super().refresh(nolock=nolock, lock_args=lock_args)

    def close(self) -> None:
        if not self.disable and self.leave is not False:
            self.display()
        self.leave = False
        super().close()


def progress_bar(*, file: TextIO | None = None, **kwargs: Any) -> tqdm[Any]:
    """A tqdm bar on ``file`` (stderr by default) that redraws only in a terminal.

    Takes tqdm's own keyword arguments (``total``, ``desc``, ``unit`` ...).
    """
    stream = sys.stderr if file is None else file
    if stream.isatty():
        return tqdm(file=stream, **kwargs)
    kwargs.setdefault("mininterval", LOG_INTERVAL_S)
    return LogLineBar(file=stream, **kwargs)
