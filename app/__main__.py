"""`python -m app` (or `finetune ui`): serve the fine-tuning GUI (the code is in `app.door.server`)."""
import sys

from app.door.server import main

sys.exit(main())
