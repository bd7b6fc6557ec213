"""`python -m ortflow ...`: the same as the `ortflow` command (torchrun starts ranks this way)."""

from ortflow.cli.train import main

main()
