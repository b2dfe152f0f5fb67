"""Task kinds as plug-ins: one module per kind (`classification`, `causal_lm`) behind one protocol (`base.TaskKind`),
found through a light registry (`finetune.registry`, a floor below the configuration) that the configuration and the
GUI read without importing torch."""
