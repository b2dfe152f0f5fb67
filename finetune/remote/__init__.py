"""Training elsewhere: a run as a Hugging Face Job or a Slurm job, followed, stopped, re-attached to and fetched
like a local run. `backend` holds the protocol every backend implements and the registry `--backend` chooses from;
`hf_backend` is Hugging Face Jobs' implementation (the modules below), `slurm/` is Slurm's.

The backend API (what `finetune train --backend hf-jobs`, `finetune jobs …` and the app call; each function takes
the token to act with, so a server acts for each signed-in user with their own):

- `hfjobs.check(config, JobOptions) -> (Preflight, image, run_dir, previous)`: every refusal that costs nothing
  (flavor, image, run folder, the plan for the flavor's GPU, the time limit), before anything is created.
- `hfjobs.launch(config, JobOptions, token=…) -> JobHandle`: upload the inputs, start the job, write `job.json`.
- `hfjobs.attach(run_dir) -> JobHandle`: the job of a run folder, after the launcher is gone.
- `hfjobs.status(handle) -> JobState`; `hfjobs.cancel(handle)`.
- `follow.follow(handle, on_record=…, on_log=…) -> Outcome` (or a `follow.Follower`, re-runnable after an
  interrupt): blocks until the job ends, mirroring its events into the run folder's `events.jsonl`.
- `fetch.fetch(handle) -> [files]`: the finished run folder (all but the checkpoints) from the bucket.

Modules: `flavors` (the hardware table), `preflight` and `timelimit` (the plan for the flavor, the time limit),
`inputs` (what is uploaded, and the config the job runs), `jobfile` (job.json), `mirror` (events from the logs,
and what the job's end means), `hfjobs` (starting, reading and cancelling the job), `follow`, `fetch`, `args` and
`cli` (the commands).
User guide: docs/jobs.md.
"""
