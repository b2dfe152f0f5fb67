"""The run directory: config, plan, events, checkpoints, trackers, the model card, and the storage it
lives on (a mounted bucket, a disk, the container's own files)."""
