"""The Export tab: download and push the model, export it for local inference (merged weights or a GGUF), and the
config that reproduces the run (Export and Import config)."""
