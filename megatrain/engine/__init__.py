"""The step on the executor: the layer schedule (executor.py), weight slots, gradient egress, batch checks,
activation checkpoints, streams, torch's process-wide settings, and the AdamW math the optimizer workers run."""
