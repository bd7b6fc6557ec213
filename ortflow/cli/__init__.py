"""The command-line entry points, each a thin shell over the package: `ortflow` (train.py, Hydra's entry point),
`ortflow-bench`, `ortflow-check`, `ortflow-predict`, `ortflow-compare`."""
