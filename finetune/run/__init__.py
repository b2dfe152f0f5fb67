"""The run directory: config, plan, events, checkpoints, trackers, the model card and the Hub."""
