"""Convert between Megatron-LM checkpoints (torch_dist) and llamapipe checkpoints, in any parallel layout.

  llamapipe convert-megatron import --load MEGATRON_DIR --save DIR [--tensor-model-parallel-size T
      --pipeline-model-parallel-size P --num-layers-per-virtual-pipeline-stage V]
  llamapipe convert-megatron export --load DIR --save MEGATRON_DIR

Import reads a Megatron save directory (latest_checkpointed_iteration.txt + iter_XXXXXXX/, or one iter dir) in
torch_dist format, whatever TP/PP Megatron saved it with (the DCP tensors are global), or in the legacy
`--ckpt-format torch` (mp_rank_XX[_YYY]/model_optim_rng.pt, put back together by its args' tp x pp), takes the model shape,
RoPE base and vocabulary from its common.pt args, and writes our checkpoint at Megatron's iteration, model
weights only (train from it with --finetune or --no-load-optim). Export writes any checkpoint of ours as a
torch_dist iter directory that megatron-core's dist_checkpointing.load reads into GPTModel's sharded state
dict, with common.pt (args, iteration) and latest_checkpointed_iteration.txt. Key map and what is carried:
docs/megatron_checkpoints.md. Bad input ends with one plain error line and exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from llamapipe.training.checkpointing import io as cio
from llamapipe.training.checkpointing import megatron_format as mf
from llamapipe.training.checkpointing.megatron_read import read_megatron, run_config
from llamapipe.training.checkpointing.megatron_write import export_megatron
from llamapipe.training.checkpointing.resharding import model_specs
from llamapipe.training.flag_parser import FlagParser
from llamapipe.tools.convert_hf import _write_import


def import_megatron(load: str, save_dir: str, tp: int = 1, pp: int = 1, vpp: int = 1, *,
                    overwrite: bool = False) -> str:
    config, full, common, path, _ = read_megatron(load)
    try:
        specs = model_specs(config, tp)
    except ValueError as exc:
        raise ValueError(f"--tensor-model-parallel-size {tp} does not fit this model: {exc}") from None
    iteration = int(common.get("iteration", 0) or 0)
    consumed = int(getattr(common["args"], "consumed_train_samples", 0) or 0)
    full = mf.fit_rows(full, config.padded_vocab_size(1))
    return _write_import(save_dir, overwrite, lambda progress: cio.write_layout(
        save_dir, iteration, full, specs, dataclasses.asdict(config), tp=tp, pp=pp, vpp=vpp,
        config=run_config(config, common["args"], tp, pp, vpp), progress=progress, consumed_samples=consumed))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(prog="llamapipe convert-megatron", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Megatron save (torch_dist or legacy) -> llamapipe checkpoint",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    imp.add_argument("--load", required=True, help="Megatron save directory (or one iter_XXXXXXX dir), torch_dist or legacy torch")
    imp.add_argument("--save", required=True, help="checkpoint directory to write (Megatron's iteration, weights)")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size of the written layout")
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size of the written layout")
    imp.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=1, help="virtual stages (VPP)")
    imp.add_argument("--overwrite-save", action="store_true", help="delete the checkpoints already in --save first")
    exp = sub.add_parser("export", help="llamapipe checkpoint -> Megatron torch_dist save",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    exp.add_argument("--load", required=True, help="a save directory of ours or one iter_XXXXXXX directory")
    exp.add_argument("--save", required=True, help="Megatron save directory to write")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.command == "import":
            out = import_megatron(args.load, args.save, args.tensor_model_parallel_size,
                                  args.pipeline_model_parallel_size, args.num_virtual_stages_per_pipeline_rank,
                                  overwrite=args.overwrite_save)
            print(f"wrote {out}")
        else:
            print(f"wrote {export_megatron(args.load, args.save)}")
    except (ValueError, OSError, KeyError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"convert_megatron.py: error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
