"""Stages of one slow action (`%pagedkv load`), shown where the user looks and saved well.

In a kernel: one display output updated in place (an HTML progress bar with its text), cleared
when the action ends, so a saved notebook keeps no bar frozen at its first stage (a tqdm widget
leaves its initial text behind wherever widgets do not run). In a terminal: a tqdm text bar.
"""
from __future__ import annotations

import html
import time


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class Stages:
    def __init__(self, total: int, first: str, enabled: bool = True, display=None) -> None:
        self.total, self.done, self.desc = total, 0, first
        self.t0 = time.perf_counter()
        self._handle = self._bar = None
        if not enabled:
            return
        if display is not None or _in_kernel():
            if display is None:
                from IPython.display import display
            self._handle = display(self._bundle(), raw=True, display_id=True)
        else:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=first, bar_format="{desc} {n}/{total} |{bar}| {elapsed}")

    def _bundle(self) -> dict[str, str]:
        text = f"{self.desc} ({self.done}/{self.total}, {time.perf_counter() - self.t0:.1f} s)"
        return {"text/plain": text,
                "text/html": f"<progress value='{self.done}' max='{self.total}'></progress> {html.escape(text)}"}

    def next(self, desc: str) -> None:
        """The previous stage is done; `desc` starts."""
        self.done, self.desc = self.done + 1, desc
        if self._handle is not None:
            self._handle.update(self._bundle(), raw=True)
        elif self._bar is not None:
            self._bar.update()
            self._bar.set_description(desc)

    def close(self) -> None:
        """Leave nothing behind: the caller prints what was done."""
        if self._handle is not None:
            self._handle.update({"text/plain": ""}, raw=True)
        elif self._bar is not None:
            self._bar.close()
