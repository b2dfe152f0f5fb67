"""`python -m finetune`, so that `accelerate launch -m finetune train …` works."""

from finetune.cli import run

run()
