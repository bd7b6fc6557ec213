"""Benchmarks: `ortflow-bench`'s driver, its measurement processes and tables, and the data pipeline's benchmarks."""
