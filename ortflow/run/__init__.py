"""One run's lifecycle: the runner (build -> loop -> results), the run dir that owns what a run writes (records,
checkpoints), the training loop, signals, seeding, metadata, launching processes and the inference export."""
