"""The app's local child processes — a run elsewhere, on Hugging Face Jobs or Slurm, is `app.remote`'s: the training
run, the export and the planner (each a `finetune` command in a child of its own, started in `children`; the runs
waiting for the one in progress in `queue`), bounded previews of a visitor's input (`bounded`), and
`client.JobClient`, the one client the tabs ask for all of them."""
