#!/usr/bin/env python3
"""The rollout gate: ``kimi-k3-serve check`` without installing the console script.

    python scripts/capacity_check.py --config deploy/config.yaml --cluster cluster_configs/aws-h200-p5en.yaml
    python scripts/capacity_check.py --config deploy/config.yaml --address auto --json --plot fit.png

Exit codes: 0 fits, 1 does not fit, 2 bad input (config, cluster file or address).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a checkout: the package next to this script wins over any installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimi_k3_serve.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["check", *sys.argv[1:]]))
