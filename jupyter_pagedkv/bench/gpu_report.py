"""What a part of the GPU check found: a `Report` saved after every finding, so a part cut off by
its time slice still hands the driver what it had measured."""
from __future__ import annotations

import json
from pathlib import Path

import torch


class Report:
    """What a part found: status, summary lines for the markdown report, data for the JSON."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {"status": "running", "summary": []}
        self.save()

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.data["summary"].append(text)
        self.save()

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    def finish(self, ok: bool) -> None:
        self.data["status"] = "pass" if ok else "fail"
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


