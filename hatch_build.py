"""Build hook giving `kernels/` (which has no `__init__.py`, see kernels/README.md) a package
`__init__` under its installed name `jupyter_pagedkv_kernels`.

- wheel: the directory is copied by `force-include`; this adds a docstring-only `__init__.py`.
- editable: nothing is copied; a two-line `__init__.py` sets `__path__` to the checkout's
  `kernels/`, so edits there take effect without reinstalling.
"""
from __future__ import annotations

import os
import tempfile

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

TARGET = "jupyter_pagedkv_kernels/__init__.py"
WHEEL_INIT = '"""Triton kernels of jupyter-pagedkv (the repository\'s kernels/ directory)."""\n'
EDITABLE_INIT = '''"""Editable install of jupyter-pagedkv: the modules of this package are read from {path}."""
__path__ = [{path!r}]
'''


class KernelsPackageHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        init = os.path.join(tempfile.mkdtemp(prefix="pagedkv-build-"), "__init__.py")
        kernels = os.path.join(self.root, "kernels")
        with open(init, "w", encoding="utf-8") as f:
            f.write(EDITABLE_INIT.format(path=kernels) if version == "editable" else WHEEL_INIT)
        if version == "editable":
            # Replaces the force-include map for this build: no stale copy of kernels/.
            build_data["force_include_editable"][init] = TARGET
        else:
            build_data["force_include"][init] = TARGET
