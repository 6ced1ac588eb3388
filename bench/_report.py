"""What every benchmark's report writes beside its table."""

from __future__ import annotations

import argparse
import json
from typing import Any


def write_json(args: argparse.Namespace, **results: Any) -> None:
    """``args.out``: the options of the run (as text) and its ``results``."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    **results}, indent=2))
