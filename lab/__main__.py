"""`python -m lab NAME ...`: the lab's benches (`lab.cli`), from a checkout."""

from __future__ import annotations

import sys

from lab.cli import main

if __name__ == "__main__":
    sys.exit(main())
