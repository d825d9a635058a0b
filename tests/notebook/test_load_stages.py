"""`%pagedkv load`'s stages: updated in place in a kernel and cleared at the end, so a saved
notebook keeps no bar frozen at its first stage."""
from __future__ import annotations

from jupyter_pagedkv.notebook.progress import Stages


class Handle:
    def __init__(self, shown: list) -> None:
        self.shown = shown

    def update(self, data, raw):
        self.shown.append(data)


def test_stages_update_one_display_in_place_and_leave_it_empty():
    shown = []

    def display(data, raw, display_id):
        shown.append(data)
        return Handle(shown)

    bar = Stages(3, "importing", display=display)
    bar.next("loading")
    bar.next("starting")
    bar.close()
    texts = [d["text/plain"] for d in shown]
    assert texts[0].startswith("importing (0/3") and texts[1].startswith("loading (1/3")
    assert texts[2].startswith("starting (2/3") and texts[-1] == ""
    assert "<progress value='1' max='3'>" in shown[1]["text/html"]


def test_disabled_stages_show_nothing(capsys):
    bar = Stages(3, "importing", enabled=False)
    bar.next("loading")
    bar.close()
    assert capsys.readouterr() == ("", "")
