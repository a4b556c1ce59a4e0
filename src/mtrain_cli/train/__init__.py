"""Training: loss, optimiser and schedule, checkpoints, progress, and the loop that ties them."""
