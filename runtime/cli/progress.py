"""Progress display shared by the training commands (one bar per stage on stderr)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# Stage keys the trainers report, and how the bars name them.
_STAGES = {
    "vq": "VQ tokenizer",
    "tokenize": "tokenise dataset",
    "gpt": "target GPT",
    "drafter": "drafter",
    "classifier": "classifier",
    "evaluate": "evaluate",
}


@contextmanager
def training_progress() -> Iterator[Callable[[str, int, int, dict[str, float]], None]]:
    """Yield a training progress callback drawing one bar per stage on stderr (plain lines now
    and then without a terminal)."""
    console = Console(stderr=True)
    tasks: dict[str, int] = {}
    last_line = [0.0]
    bar = Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=console)

    def progress(stage: str, done: int, total: int, info: dict[str, float]) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(_STAGES.get(stage, stage), total=max(total, 1), info="")
        text = "  ".join(f"{k} {v:.4f}" for k, v in info.items())
        bar.update(tasks[stage], completed=done, total=max(total, 1), info=text)
        # Without a terminal the bar is not redrawn: log a plain line now and then instead.
        now = time.monotonic()
        if not console.is_terminal and (now - last_line[0] > 30 or done == total):
            last_line[0] = now
            console.print(f"{_STAGES.get(stage, stage)}: {done}/{total} {text}", highlight=False)

    with bar:
        yield progress
