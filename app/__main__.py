"""`python -m app` (or `finetune ui`): serve the fine-tuning GUI (the code is in `app.serve`)."""
import sys

from app.serve import main

sys.exit(main())
