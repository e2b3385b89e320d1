"""
Progress of long work (a benchmark grid, a report over many snapshots, counterfactual retraining), in the spirit of
SB3's ``learn(progress_bar=True)``: a tqdm bar when the output is a terminal and tqdm is installed, else plain
lines, flushed, at most one every ``interval`` seconds (plus the ones asked for with ``force``), so that a log under
``nohup`` or a pipe is timely and not flooded.

The ETA is the mean wall time per unit measured since the reporter started (elapsed time / units done) times the
units left: it assumes that the units left cost what the finished ones did, and it includes the parallelism of the
workers, if any (their units all count). The bar shows the same estimate (tqdm with ``smoothing=0``).
"""

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO


def format_duration(seconds: float) -> str:
    """``"45s"``, ``"12m05s"``, ``"3h07m"``."""
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _tqdm_class() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """
    Progress of ``total`` units of work (rounds, snapshots, retrainings).

    :param total: Number of units.
    :param unit: Name of a unit, singular (``"round"``).
    :param desc: What is being done, shown first (``"bench run"``).
    :param enabled: ``False``: report nothing (every method does nothing).
    :param stream: Where to write (default: ``sys.stdout`` when the reporter is made).
    :param interval: Plain lines: at least this many seconds between two lines (``force`` ignores it); 0 prints one
        line per update.
    :param bar: ``None``: a tqdm bar when ``stream`` is a terminal and tqdm is installed, plain lines otherwise;
        ``True``: a bar (tqdm must be installed); ``False``: plain lines.
    :param clock: The time in seconds (monotonic), for the ETA and the rate limit.
    """

    def __init__(
        self,
        total: int,
        unit: str = "round",
        desc: str = "",
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 30.0,
        bar: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be an int >= 0 (the number of units of work), got {total!r}")
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval >= 0:
            raise ValueError(f"interval must be a number of seconds >= 0 between two progress lines, got {interval!r}")
        self.total = total
        self.unit = unit
        self.desc = desc
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stdout
        self.interval = float(interval)
        self.clock = clock
        self.done = 0
        self.status = ""
        self.lines = 0
        self._start = clock()
        self._last_line = self._start
        self._shown: tuple[int, str] | None = None
        self._bar: Any = None
        if not enabled:
            return
        tqdm = _tqdm_class()
        if bar is None:
            isatty = getattr(self.stream, "isatty", None)
            bar = tqdm is not None and callable(isatty) and bool(isatty())
        if bar:
            if tqdm is None:
                raise ImportError("bar=True needs tqdm: pip install tqdm (or pass bar=None for plain lines without it)")
            self._bar = tqdm(total=total, unit=unit, desc=desc or None, file=self.stream, smoothing=0, dynamic_ncols=True)

    def elapsed(self) -> float:
        """Seconds since the reporter was made."""
        return self.clock() - self._start

    def eta(self) -> float | None:
        """Seconds left (mean time per unit so far times the units left); ``None`` before the first unit is done."""
        if self.done <= 0:
            return None
        return self.elapsed() / self.done * max(0, self.total - self.done)

    def line(self) -> str:
        """The plain progress line: units done, the status, the elapsed time and the ETA."""
        parts = [f"{self.desc}: " if self.desc else "", f"{self.done}/{self.total} {self.unit}s"]
        if self.status:
            parts.append(f" | {self.status}")
        eta = self.eta()
        timing = f"{format_duration(self.elapsed())} elapsed"
        if eta is None:
            timing += ", ETA after the first " + self.unit
        elif self.done >= self.total:
            timing += ", all done"
        else:
            timing += f", ETA {format_duration(eta)} ({format_duration(self.elapsed() / self.done)}/{self.unit})"
        parts.append(f" | {timing}")
        return "".join(parts)

    def update(self, n: int = 1, status: str | None = None, force: bool = False) -> None:
        """
        Count ``n`` more units done and show the progress (plain lines: only when ``interval`` has passed since
        the last line, or with ``force``).

        :param n: Units done since the last update (0: only the status changed).
        :param status: The new status text (what is running now); ``None`` keeps the current one.
        :param force: Plain lines: print now whatever the rate limit (for an event worth a line, a run's end).
        """
        if not self.enabled:
            return
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0 (units done since the last update), got {n!r}")
        self.done += n
        if status is not None:
            self.status = status
        if self._bar is not None:
            if status is not None:
                self._bar.set_postfix_str(status, refresh=False)
            self._bar.update(n)
            if force:
                self._bar.refresh()
            return
        now = self.clock()
        if force or now - self._last_line >= self.interval:
            self._print()
            self._last_line = now

    def _print(self) -> None:
        print(self.line(), file=self.stream, flush=True)
        self._shown = (self.done, self.status)
        self.lines += 1

    def write(self, text: str, emit: Callable[[str], None] = print) -> None:
        """
        Write a line of another kind without breaking the bar.

        :param text: The line.
        :param emit: What writes it (``print``, a logger's method).
        """
        if self._bar is not None:
            with self._bar.external_write_mode(file=self.stream):
                emit(text)
        else:
            emit(text)

    def close(self) -> None:
        """
        End the bar; plain lines: print the last state if a line was printed before and the state has changed since
        (short work stays silent).
        """
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self.lines and self._shown != (self.done, self.status):
            self._print()
        self.enabled = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
