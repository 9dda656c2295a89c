"""The run's life: its flags and presets (config, presets), its start and directory (start, rundir), the
devices and precision it computes in, its randomness and batches, its optimizers, and what it keeps (checkpoint,
tracking, metrics)."""
