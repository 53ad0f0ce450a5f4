"""Test-only launcher: training under --enable-optimizer-post-validation where every rank speculates on every step
the speculation policy allows, whatever its own statistics and timing say, so which steps speculate (and roll
back) follows from the global grad norms alone.

    torchrun ... tests/scripts/speculate_eagerly.py <pretrain_llama.py flags>
"""
import sys

from llamapipe.training.post_validated import PostValidatedStep

PostValidatedStep.speculation = "eager"

if __name__ == "__main__":
    from llamapipe.train import main
    sys.exit(main(sys.argv[1:]))
