"""The app's local child processes — a run elsewhere, on Hugging Face Jobs or Slurm, is `app.remote`'s: the training
run, the export and the planner (each a `finetune` command in a child of its own, started in `children`; the runs
waiting for the one in progress in `queue`), and bounded previews of a visitor's input (`bounded`). The one client
the tabs ask for all of them, here or elsewhere, is `app.client.JobClient`, above this package and `app.remote`."""
