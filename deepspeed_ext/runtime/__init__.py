"""The training runtime (layer 5): engine, precision, schedules, checkpoints."""
