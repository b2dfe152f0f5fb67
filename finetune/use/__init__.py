"""Using a trained run: prediction and evaluation of saved models."""
