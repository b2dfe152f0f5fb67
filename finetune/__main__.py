"""`python -m finetune`, so that `accelerate launch -m finetune train …` works."""

import os

from finetune.errors import EXIT_STOPPED

try:
    from finetune.cli import run
except KeyboardInterrupt:  # a Stop while the command still imports its modules: a stopped run, not a traceback
    os._exit(EXIT_STOPPED)

run()
