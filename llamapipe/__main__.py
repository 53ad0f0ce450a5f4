"""`python -m llamapipe <subcommand>`: the same as the installed `llamapipe` command."""
import sys

from llamapipe.cli import main

sys.exit(main())
