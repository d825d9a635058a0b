"""What the benchmarks' command lines share: a count argument checked when it is parsed, so a bad
one is argparse's one line (usage and the rule) instead of a traceback after minutes of work."""
from __future__ import annotations

import argparse
from typing import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An argparse `type`: an integer >= `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"          # argparse names the type by it in its message
    return parse
