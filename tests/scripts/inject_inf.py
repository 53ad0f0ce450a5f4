"""Test-only launcher: pretrain_llama.py with an infinite loss at one iteration (fp16 skip test).

    torchrun ... tests/scripts/inject_inf.py --inject-inf-iteration 3 -- <pretrain_llama.py flags>
The patch lives here, not in the library: it wraps the loss function of llamapipe/training/setup.py.
"""
import sys

import llamapipe.training.loop as training
import llamapipe.training.setup as setup
from llamapipe.train import main as pretrain_main


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    target = int(argv[argv.index("--inject-inf-iteration") + 1])
    original_step = training.Trainer.train_step
    original_loss = setup.loss_func

    def train_step(self):
        def loss_func(loss_mask, output):
            loss_sum, tokens, logs = original_loss(loss_mask, output)
            if self.state.iteration + 1 == target:
                loss_sum = loss_sum * float("inf")
            return loss_sum, tokens, logs
        setup.loss_func = loss_func
        try:
            return original_step(self)
        finally:
            setup.loss_func = original_loss

    training.Trainer.train_step = train_step
    return pretrain_main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
