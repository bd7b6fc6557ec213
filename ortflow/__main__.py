"""`python -m ortflow ...`: the same as the `ortflow` command (a torchrun started by hand starts ranks this way)."""

from ortflow.cli.train import main

main()
