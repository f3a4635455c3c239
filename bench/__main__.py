"""``python -m bench``: the benchmark's command line (bench/bench.py)."""

from __future__ import annotations

import sys

from bench.bench import main

sys.exit(main())
