"""The window's arithmetic: exact loss sums, backward, optimizer step, evaluation, device and precision."""
