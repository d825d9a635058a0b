"""JUPYTER_PAGEDKV_NATIVE=0: one switch that stands every C++ kernel down, so the fallbacks run.

The C++ prefill attention kernel serves only AVX-512 CPUs and the C++ decode loop and decode
attention kernel only where they build; most laptops run the fallbacks (torch's SDPA, the Python
step loop). CI runs the exactness tests a second time with the switch set (the Makefile's `test`
target), so both paths are checked on every machine, whatever its ISA. Read when an engine plans
its steps, never at import, so a test may set it for one engine."""
from __future__ import annotations

import os

ENV = "JUPYTER_PAGEDKV_NATIVE"
_OFF = ("0", "false", "off", "no")


def native_disabled() -> str | None:
    """None when native kernels may run; else the reason, as plans print it."""
    value = os.environ.get(ENV, "")
    if value.strip().lower() in _OFF:
        return f"{ENV}={value} forces the fallbacks"
    return None
