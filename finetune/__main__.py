"""`python -m finetune`, so that `accelerate launch -m finetune train …` works."""

import sys

from finetune.cli import main

sys.exit(main())
