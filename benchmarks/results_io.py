"""Where every benchmark writes its JSON: the path's folder is created, and the path is printed."""
from __future__ import annotations

import json
import os


def write_json(path: str, result, indent: int = 2) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=indent)
    print(f"wrote {path}")
