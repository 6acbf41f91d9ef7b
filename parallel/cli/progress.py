"""What the command line shows while it works, on stderr, in the CLI process: the phases (start pool, load,
encode text, sample, decode, write) with the seconds since the command started, and a progress bar for the
steps (tqdm: rate in it/s or s/it and the time left) on a terminal; plain lines when stderr is not a terminal
(a file, a pipe); nothing with ``--quiet``. A terminal that cannot print UTF-8 gets tqdm's ASCII bar.

The seconds count from the process's start (read from /proc where there is one), so the final line's wall time
includes the interpreter's and the imports' start-up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time

_IMPORTED = time.perf_counter()
PLAIN_LINE_EVERY_S = 5.0  # without a terminal: a step line at most this often (first and last always)


def _process_age_s() -> float:
    """Seconds since this process started (Linux /proc; elsewhere since this module loaded)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started_ticks = float(stat.read().rpartition(")")[2].split()[19])
            return max(float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


_STARTED = _IMPORTED - _process_age_s()


def elapsed_s() -> float:
    """Seconds since the command started, start-up included."""
    return time.perf_counter() - _STARTED


def _stream_is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _speaks_utf8(stream) -> bool:
    return (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "") == "utf8"


class Progress:
    """One command's phases and step counts; ``quiet`` prints none of them."""

    _open: list["Progress"] = []  # progress with a bar or line still open (closed before an error is printed)

    def __init__(self, quiet: bool = False, stream=None):
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = _stream_is_terminal(self.stream)
        self.bar = None
        self.last_line = 0.0
        self.step_started = self.last_time = time.perf_counter()
        self.last_step = 0

    def say(self, text: str) -> None:
        """A line of its own (the plan, a note), unless quiet."""
        if not self.quiet:
            self.close_bar()
            self._line(text)

    def _line(self, text: str) -> None:
        """One write with its newline (print writes the newline apart: a Ctrl-C between the two would leave the
        line open and "interrupted" glued to it)."""
        self.stream.write(text + "\n")
        self.stream.flush()

    @contextlib.contextmanager
    def phase(self, name: str, timings=None, key: str | None = None):
        """``name`` announced with the seconds since start; timed into ``timings`` (a RunTimings) under ``key``."""
        self.say(f"[{elapsed_s():7.1f} s] {name}")
        if timings is None or key is None:
            yield
            return
        with timings.phase(key):
            yield

    def steps(self, label: str = "sample", unit: str = "step"):
        """A ``progress(step, total)`` callback (called after each step; its clock starts now): a tqdm bar on a
        terminal, else plain lines. A count that starts again (the next chunk) starts a new bar from the last."""
        if self.quiet:
            return lambda step, total: None
        self.step_started, self.last_step = time.perf_counter(), 0
        return lambda step, total: self._step(label, unit, step, total)

    def _step(self, label: str, unit: str, step: int, total: int) -> None:
        Progress._open.append(self) if self not in Progress._open else None
        now = time.perf_counter()
        if step < self.last_step:  # a new count (the next chunk): its clock starts at the last step's end
            self.close_bar()
            self.step_started = self.last_time
        self.last_step, self.last_time = step, now
        if self.terminal:
            self._bar_step(label, unit, step, total)
        elif step in (1, total) or now - self.last_line >= PLAIN_LINE_EVERY_S:
            self.last_line = now
            self._line(f"  {label} {unit} {step}/{total}{_rate(now - self.step_started, step, total - step, unit)}")

    def _bar_step(self, label: str, unit: str, step: int, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None or self.bar.total != total:
            self.close_bar()
            size = shutil.get_terminal_size((100, 24))  # (a terminal that reports no size: 100 x 24, else tqdm hides)
            self.bar = tqdm(total=total, desc=f"  {label}", unit=unit, file=self.stream, ncols=min(size.columns, 120),
                            nrows=size.lines, ascii=not _speaks_utf8(self.stream), leave=True, smoothing=0.3)
            # the first step's time counts too (tqdm's clock is its own)
            self.bar.start_t = self.bar.last_print_t = self.bar._time() - (time.perf_counter() - self.step_started)
        self.bar.update(step - self.bar.n)
        if step >= total:
            self.close_bar()

    def runs(self, label: str, total: int):
        """A ``run(what)`` callback called before each of ``total`` measured runs (a benchmark's): the line
        ``label: run n/total (what)`` with the time per run and the time left so far; nothing when quiet. Lines on a
        terminal too: a run takes seconds to minutes and each line says what it measures."""
        started, count = time.perf_counter(), [0]

        def run(what: str = "") -> None:
            count[0] += 1
            if not self.quiet:
                done = count[0] - 1
                rate = _rate(time.perf_counter() - started, done, total - done, "run")
                self.say(f"{label}: run {count[0]}/{total}" + (f" ({what})" if what else "") + rate)

        return run

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    @classmethod
    def close_all(cls) -> None:
        """Close open bars so that an error or "interrupted" starts on its own line."""
        for progress in cls._open:
            progress.close_bar()
        cls._open.clear()


def _rate(seconds: float, done: int, left: int, unit: str = "step") -> str:
    """`, 1.52 s/step, 12 s left` (or steps/s when faster than one a second): ``done`` steps took ``seconds``."""
    if done < 1 or seconds <= 0:
        return ""
    per_step = seconds / done
    speed = f"{per_step:.2f} s/{unit}" if per_step >= 1 else f"{1 / per_step:.2f} {unit}s/s"
    return f", {speed}, {per_step * left:.0f} s left"


def finished(text: str) -> None:
    """The result line on stdout, with the whole wall time since the process started."""
    print(f"{text} in {elapsed_s():.1f} s", flush=True)
