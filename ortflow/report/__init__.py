"""Where a run reports: the TensorBoard/metrics logger, the terminal, the closing summary, sweep summaries, plots and
per-operator profiles."""
