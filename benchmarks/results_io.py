"""Where every benchmark writes its JSON: the path's folder is created, the machine is recorded, and the path is
printed."""
from __future__ import annotations

import json
import os
import platform


def machine() -> dict:
    """What a result was measured on, so docs/benchmarks.md can say it (torch is imported lazily: the data
    benchmark's numbers do not need it)."""
    import torch
    return {"torch": torch.__version__, "platform": platform.platform(), "cpus": os.cpu_count(),
            "loadavg_1min": os.getloadavg()[0]}


def write_json(path: str, result, indent: int = 2) -> None:
    if isinstance(result, dict) and "machine" not in result:
        result = {**result, "machine": machine()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=indent)
    print(f"wrote {path}")
