"""Compiling this package's C++ sources with torch's extension builder, once per machine.

Why one place: every C++ module here is built the same way (g++ and ninja, found even when the
virtual environment is not activated; torch caches the result for every later process), and a
user should hear once, in one line, that the first load pauses while it builds.

Why a hashed name: torch's cache keeps one build per name, and ninja rebuilds it whenever the
command changes (other flags, another source path, another venv's torch headers). So each variant
is built as `<name>_<hash of its sources, flags and torch>`: the GPU rehearsal's venv or a test's
broken source gets its own build instead of invalidating the one the user's next load needs.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


class NativeBuildError(RuntimeError):
    """A C++ module could not be compiled or loaded here; the message says what to install."""


class LazyModule:
    """A C++ module built on first `load()`; a failure is remembered, logged once and raised
    again as the same one line (what did not build, and the option that avoids it)."""

    def __init__(self, name: str, source: Path | list[Path], what: str, instead: str, cflags: list[str],
                 ldflags: list[str] | None = None) -> None:
        self.name, self.source, self.what, self.instead = name, source, what, instead
        # Tuples: torch's loader appends its own link flags to the lists it is given, which
        # would change this variant's name after its first load.
        self.cflags, self.ldflags = tuple(cflags), tuple(ldflags or ())
        self._lock = threading.Lock()
        self._module = None
        self._error: str | None = None

    @property
    def build_name(self) -> str:
        """The name torch's cache keeps this variant under (see the module docstring)."""
        return variant_name(self.name, self.source, self.cflags, self.ldflags)

    def load(self):
        with self._lock:
            if self._module is not None:
                return self._module
            if self._error is not None:
                raise NativeBuildError(self._error)
            try:
                self._module = build(self.build_name, self.source, self.what, self.cflags, self.ldflags)
            except Exception as err:  # noqa: BLE001  (a compiler's many failures become one line)
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                first = first.split(": [")[0][:160]      # not the compiler's command line after it
                self._error = (f"{self.what} did not build ({first}): install g++ and ninja "
                               f"(pip install ninja), or use {self.instead}")
                logger.warning(self._error)
                raise NativeBuildError(self._error) from err
            return self._module


def variant_name(name: str, source: Path | list[Path], cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """`name` plus a short hash of everything a build depends on: each source's path and bytes,
    the headers beside the first source, the flags, and the torch (version and install place)
    whose headers it compiles against. Same inputs, same name; any change, a new name."""
    import sysconfig

    import torch

    sources = [source] if isinstance(source, Path) else list(source)
    headers = sorted(p for p in sources[0].parent.iterdir() if p.suffix in (".h", ".hpp")) \
        if sources[0].parent.is_dir() else []
    digest = hashlib.sha256()
    for path in [*sources, *headers]:
        digest.update(str(path.resolve()).encode() + b"\0")
        digest.update(path.read_bytes() if path.exists() else b"<missing>")
    for part in (*cflags, "|", *ldflags, "|", torch.__version__, os.path.dirname(torch.__file__),
                 sysconfig.get_paths().get("include", "")):
        digest.update(str(part).encode() + b"\0")
    return f"{name}_{digest.hexdigest()[:10]}"


def build(name: str, source: Path | list[Path], what: str, cflags: Sequence[str] | None = None,
          ldflags: Sequence[str] | None = None):
    """The compiled module `name` from `source` (one file or several; headers beside the first
    are found), built now if torch's cache lacks it; `what` names it in the one-line warning a
    first build gives."""
    from torch.utils.cpp_extension import load

    _find_ninja()
    if not _built(name):
        # Said where a user sees it: the first `%pagedkv load` on a machine pauses this long.
        logger.warning("building %s: once per machine, ~45 s", what)
    sources = [source] if isinstance(source, Path) else list(source)
    return load(name, sources=[str(s) for s in sources], extra_include_paths=[str(sources[0].parent)],
                extra_cflags=list(cflags or ()), extra_ldflags=list(ldflags or ()), verbose=False)


def _find_ninja() -> None:
    """Put ninja on PATH: pip's ninja lives beside this interpreter, which a venv that is not
    activated keeps off PATH."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    bindir = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(bindir, "ninja")):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def _built(name: str) -> bool:
    """Whether torch's extension cache already holds the module (asked through a private torch
    helper: if a torch lacks it, the answer is only used for a warning, so say "not built")."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
        return any(Path(_get_build_directory(name, verbose=False)).glob("*.so"))
    except Exception:  # noqa: BLE001  (only the warning depends on it)
        logger.debug("could not look into torch's extension cache", exc_info=True)
        return False
