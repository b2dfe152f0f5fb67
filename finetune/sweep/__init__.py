"""Sweeps: `finetune sweep cfg.yaml`, a hyper-parameter search whose trials are ordinary runs (docs/sweeps.md)."""
