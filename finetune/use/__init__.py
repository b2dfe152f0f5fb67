"""Using a trained run: prediction, evaluation, export, and publishing it to the Hugging Face Hub."""
