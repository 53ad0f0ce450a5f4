"""Test-only launcher: training under --enable-optimizer-post-validation where every rank speculates on every
step, so each step the synchronous path would clip or skip is rolled back, redone and its next iteration run
again (the rollback path, exercised on purpose). With --inject-inf-iteration N -- ... it wraps inject_inf.py.
With SPECULATING_RANKS=0,2 in the environment only those global ranks do; the others speculate only where their
own statistics and the timing say so, as without this script (never when their own norm clips).

    torchrun ... tests/scripts/speculate_always.py <pretrain_llama.py flags>
"""
import os
import sys

from llamapipe.core.optimizer.optimizer import Optimizer
from llamapipe.training.post_validated import PostValidatedStep

PostValidatedStep.speculation = "always"
if "SPECULATING_RANKS" in os.environ and os.environ["RANK"] not in os.environ["SPECULATING_RANKS"].split(","):
    _begin = Optimizer.begin_post_validated_step
    Optimizer.begin_post_validated_step = lambda self, loss_sum, tokens, always_speculate=False, paused=False: \
        _begin(self, loss_sum, tokens, False, paused)

if __name__ == "__main__":
    if "--inject-inf-iteration" in sys.argv:
        import inject_inf    # tests/scripts is this script's directory, first on sys.path
        sys.exit(inject_inf.main())
    from llamapipe.train import main
    sys.exit(main(sys.argv[1:]))
