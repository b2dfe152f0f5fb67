"""Training elsewhere from the app: the Train form's "Run on" choice (`choice`: this machine, then each registered
backend's entries and its own fields), and what a run elsewhere needs from the app (`jobs`): which backends this app
offers to whom, whose token and namespace on Jobs, the image, the child's environment, re-attaching to a job whose
launcher went away, and what the Run panel says of a job. The run itself is the CLI's (`finetune train … --backend
NAME`, `finetune jobs follow`), a child process like a local run.
User guide: docs/app.md and docs/jobs.md."""
