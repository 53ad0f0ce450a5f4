"""`llamapipe verify-checkpoint DIR`: check a checkpoint's files against the sizes and sha256 checksums in
its metadata.json, offline (no processes, no model). metadata.json itself is checked by the function the
loader uses (`catalog.checked_metadata`: its own checksum, its fields), so what loading rejects, this rejects.

DIR is one checkpoint (`.../iter_0000010`) or a --save directory, whose every checkpoint is checked. One
line per checkpoint: `ok`, or each damaged file and what is wrong with it. Files are hashed in parallel
threads (hashlib releases the GIL). Exit status 0 when every checkpoint checked is sound, 1 when one is
damaged, 2 when DIR holds no checkpoint.
"""
from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from llamapipe.training.flag_parser import FlagParser
from llamapipe.training.checkpointing import catalog
from llamapipe.training.checkpointing.integrity import file_defect


def defects(ckpt_dir: str, workers: int = 4) -> list[str]:
    """Every defect of one checkpoint (empty: sound); metadata problems first."""
    meta, defect = catalog.checked_metadata(ckpt_dir)     # the loader's own check of the metadata
    if meta is None:
        return [defect]
    found = []
    if meta["format_version"] < 2:
        found.append("written before checksums (format 1): only file sizes can be checked")
    files = sorted(meta["files"].items())
    with ThreadPoolExecutor(max_workers=max(workers, 1)) as pool:
        results = pool.map(lambda item: file_defect(ckpt_dir, item[0], item[1]), files)
        found += [r for r in results if r is not None]
    listed = set(meta["files"]) | {catalog.METADATA}
    found += [f"{name} is not listed in metadata.json" for name in sorted(set(os.listdir(ckpt_dir)) - listed)]
    return found


def _targets(path: str) -> Optional[list[str]]:
    if os.path.isfile(os.path.join(path, catalog.METADATA)) or os.path.basename(path.rstrip("/")).startswith("iter_"):
        return [path]
    iterations = catalog.list_iterations(path)
    return [catalog.iter_dir(path, i) for i in iterations] or None


def main(argv: Optional[list[str]] = None) -> int:
    p = FlagParser(prog="llamapipe verify-checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="a checkpoint (iter_XXXXXXX) or a --save directory holding checkpoints")
    p.add_argument("--workers", type=int, default=4, help="files hashed at once")
    args = p.parse_args(argv)
    targets = _targets(args.dir) if os.path.isdir(args.dir) else None
    if not targets:
        sys.stderr.write(f"llamapipe verify-checkpoint: error: {args.dir} is not a checkpoint and holds none\n")
        return 2
    bad = 0
    for ckpt in targets:
        found = defects(ckpt, args.workers)
        damaged = [d for d in found if not d.startswith("written before checksums")]
        bad += bool(damaged)
        sys.stdout.write(f"{ckpt}: {'; '.join(found) if found else 'ok'}\n")
    tracked = catalog.read_tracker(os.path.dirname(targets[0].rstrip("/")))
    if tracked is not None and len(targets) > 1:
        sys.stdout.write(f"tracker names iteration {tracked}\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
