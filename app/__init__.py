"""The fine-tuning GUI: a Gradio app that is a thin client of the `finetune` CLI (`python -m app`, `finetune ui`)."""
