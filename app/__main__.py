"""`python -m app` (or `finetune ui`): serve the fine-tuning GUI (the code is in `app.server`)."""
import sys

from app.server import main

sys.exit(main())
