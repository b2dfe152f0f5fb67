"""The training loop and its setup (only the CLI imports it)."""
