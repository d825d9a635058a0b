"""The widget's ES module as one text: anywidget loads `_esm` from a blob URL, where the relative
imports between the monitor's modules (`./palette.js`) cannot resolve, so each is replaced by a
`data:` URL of the module it names (recursively). The same files serve the labextension, whose
bundler follows the imports itself, and Node's tests, which import them as they are."""
from __future__ import annotations

import base64
import re
from pathlib import Path

RELATIVE_IMPORT = re.compile(r'''(\bfrom\s+|\bimport\s+)(["'])\./([\w.-]+\.js)\2''')


def inlined_module(path: Path, _seen: tuple[Path, ...] = ()) -> str:
    """`path`'s source with every `from "./x.js"` pointing at a data: URL of x.js (inlined too).
    The same module text always gives the same URL, so a module two others import is one module."""
    if path in _seen:
        raise ValueError(f"import cycle between the monitor's modules: {' -> '.join(p.name for p in (*_seen, path))}")
    source = path.read_text()

    def data_url(match: re.Match) -> str:
        text = inlined_module(path.parent / match.group(3), (*_seen, path))
        encoded = base64.b64encode(text.encode()).decode()
        return f'{match.group(1)}"data:text/javascript;base64,{encoded}"'

    return RELATIVE_IMPORT.sub(data_url, source)
