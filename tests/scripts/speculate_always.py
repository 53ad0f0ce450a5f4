"""Test-only launcher: training under --enable-optimizer-post-validation where every rank speculates on every
step, so each step the synchronous path would clip or skip is rolled back, redone and its next iteration run
again (the rollback path, exercised on purpose). With --inject-inf-iteration N -- ... it wraps inject_inf.py.

    torchrun ... tests/scripts/speculate_always.py <pretrain_llama.py flags>
"""
import sys

from llamapipe.training.post_validated import PostValidatedStep

PostValidatedStep.speculation = "always"

if __name__ == "__main__":
    if "--inject-inf-iteration" in sys.argv:
        import inject_inf    # tests/scripts is this script's directory, first on sys.path
        sys.exit(inject_inf.main())
    from llamapipe.train import main
    sys.exit(main(sys.argv[1:]))
