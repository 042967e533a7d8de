"""Pieces every benchmark script shares (imported as ``_shared``: the scripts run from
``benchmarks/`` as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from cospec.errors import CoSpecError


def hardware() -> dict[str, object]:
    """What the numbers were measured on, recorded in every benchmark's JSON."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def run_script(main: Callable[[], object]) -> None:
    """Run a benchmark's ``main`` the way ``cospec`` runs a subcommand: bad input (a wrong
    path, a drafter with another vocabulary, an empty workload) is one ``NAME: error: ...``
    line and exit status 2, not a traceback from deep inside."""
    try:
        main()
    except CoSpecError as err:
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
        sys.exit(2)
