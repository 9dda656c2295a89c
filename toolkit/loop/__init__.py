"""The training loop (training: TrainingLoop, the generator facade) and its parts: progress, cadence, agreement,
losses, guards, evaluation, meter, keeper, summary."""
