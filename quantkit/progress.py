"""One look for every progress bar a user waits on, and how far a Ctrl-C'd job got.

In a terminal (or Jupyter) :func:`progress_bar` is a rich bar. When stderr is not a terminal (CI logs, a
redirect), it is :class:`PlainProgress`: the same calls, printing plain lines such as
``Quantizing (gptq): block 12/30, 1m05s elapsed, ETA 1m38s`` when a unit completes (at most one such line every
:data:`PLAIN_INTERVAL_S` seconds; the last unit always gets one) and, while a unit takes longer, a line repeating the
count after :data:`PLAIN_INTERVAL_S` seconds of silence, so a log never goes quiet for a whole stage.

:class:`Interrupted` is the ``KeyboardInterrupt`` a long job raises with its progress (``after block 11/30``) and
how to go on (``rerun with --resume to continue``); the CLI prints :meth:`Interrupted.message` and exits 130.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)
_clock = time.monotonic  # seconds; the tests put a fake clock here
PLAIN_INTERVAL_S = 10.0  # plain (non-terminal) progress: the most frequent completion line, and the longest silence


def progress_bar(enabled: bool = True) -> Progress | PlainProgress:
    """A progress display for ``with ... as bar: task = bar.add_task(description, total=n); bar.advance(task)``.

    ``add_task(..., unit="block")`` names what is counted in plain lines (rich keeps it as a task field)."""
    if enabled and not interactive():
        return PlainProgress()
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )


def interactive() -> bool:
    """Whether stderr shows live bars: a terminal (rich's view, so FORCE_COLOR/TTY_COMPATIBLE count) or Jupyter."""
    return bool(console.is_terminal or console.is_jupyter)


def format_duration(seconds: float) -> str:
    """``42s``, ``1m05s``, ``2h03m``."""
    total = max(0, round(seconds))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


@dataclass(slots=True)
class _PlainTask:
    description: str
    total: float | None
    completed: float
    unit: str
    start: float
    first: float  # units already done when the task was added (a resumed run): not part of the rate
    last_line: float  # any line (the heartbeat waits on this)
    last_unit_line: float = float("-inf")  # the last completion line (completion lines are throttled on this)
    visible: bool = True

    @property
    def finished(self) -> bool:
        return self.total is not None and self.completed >= self.total

    def line(self, now: float) -> str:
        count = _number(self.completed) if self.total is None else f"{_number(self.completed)}/{_number(self.total)}"
        unit = f"{self.unit} " if self.unit else ""
        elapsed = now - self.start
        text = f"{self.description}: {unit}{count}, {format_duration(elapsed)} elapsed"
        if self.total is None:
            return text
        if self.finished:
            return f"{text}, done"
        done_here = self.completed - self.first
        if done_here <= 0 or elapsed <= 0:
            return f"{text}, ETA ?"
        return f"{text}, ETA {format_duration((self.total - self.completed) * elapsed / done_here)}"


class PlainProgress:
    """Progress as plain lines on stderr (see the module docstring); the subset of rich's ``Progress`` that the
    package uses: ``with``, ``add_task``, ``advance``, ``update``, ``remove_task``, ``start``, ``stop``."""

    def __init__(self) -> None:
        self._tasks: dict[int, _PlainTask] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PlainProgress:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._heartbeat, name="quantkit-progress", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def add_task(
        self,
        description: str,
        start: bool = True,
        total: float | None = 100.0,
        completed: float = 0,
        visible: bool = True,
        **fields: Any,
    ) -> int:
        with self._lock:
            task_id = len(self._tasks)
            now = _clock()
            unit = str(fields.get("unit", ""))
            self._tasks[task_id] = _PlainTask(description, total, completed, unit, now, completed, now, visible=visible)
        return task_id

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(
        self,
        task_id: int,
        *,
        total: float | None = None,
        completed: float | None = None,
        advance: float | None = None,
        description: str | None = None,
        visible: bool | None = None,
        **fields: Any,
    ) -> None:
        with self._lock:
            task = self._tasks[task_id]
            before = task.completed
            if total is not None:
                task.total = total
            if completed is not None:
                task.completed = completed
            if advance is not None:
                task.completed += advance
            if description is not None:
                task.description = description
            if visible is not None:
                task.visible = visible
            if "unit" in fields:
                task.unit = str(fields["unit"])
            now = _clock()
            if task.completed > before and (task.finished or now - task.last_unit_line >= PLAIN_INTERVAL_S):
                task.last_unit_line = now
                self._emit(task, now)

    def remove_task(self, task_id: int) -> None:
        with self._lock:
            self._tasks.pop(task_id, None)

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(1.0, PLAIN_INTERVAL_S / 2)):
            self.beat()

    def beat(self) -> None:
        """A line for each unfinished task that has printed none for :data:`PLAIN_INTERVAL_S` seconds (the
        background thread calls this about once a second)."""
        with self._lock:
            now = _clock()
            for task in self._tasks.values():
                if not task.finished and now - task.last_line >= PLAIN_INTERVAL_S:
                    self._emit(task, now)

    def _emit(self, task: _PlainTask, now: float) -> None:
        task.last_line = now
        if not task.visible:
            return
        try:
            stream = console.file
            stream.write(task.line(now) + "\n")
            stream.flush()
        except (OSError, ValueError):  # stderr closed or gone (a closed pipe): progress is not worth a crash
            pass


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during long work, with how far it got: ``interrupted [during WHERE] [after UNIT DONE/TOTAL][; HINT]``.

    A ``KeyboardInterrupt``, so code that lets Ctrl-C through lets this through too."""

    def __init__(
        self, *, done: int | None = None, total: int | None = None, unit: str = "", where: str = "", hint: str = ""
    ) -> None:
        self.done, self.total, self.unit, self.where, self.hint = done, total, unit, where, hint
        super().__init__(self.message())

    def message(self) -> str:
        text = "interrupted"
        if self.where:
            text += f" during {self.where}"
        if self.done is not None and self.total is not None:
            text += f" after {self.unit + ' ' if self.unit else ''}{self.done}/{self.total}"
        return f"{text}; {self.hint}" if self.hint else text

    def within(self, where: str, hint: str) -> Interrupted:
        """The same progress inside a larger job (a recipe's stage), with that job's way to go on."""
        return Interrupted(done=self.done, total=self.total, unit=self.unit, where=where, hint=hint)
