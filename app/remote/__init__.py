"""Training elsewhere from the app: the Train form's "Run on" choice (`choice`: this machine or a Hugging Face Jobs
flavor), and what a run on Jobs needs from the app (`jobs`): whose token and namespace, the image, the child's
environment, re-attaching to a job whose launcher went away, and what the Run panel says of a job. The run itself is
the CLI's (`finetune train … --backend hf-jobs`, `finetune jobs follow`), a child process like a local run.
User guide: docs/app.md and docs/jobs.md."""
