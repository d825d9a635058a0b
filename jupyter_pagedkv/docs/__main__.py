"""`python -m jupyter_pagedkv.docs [NAME ...]`: see `transcripts`."""
from __future__ import annotations

import sys

from .transcripts import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
