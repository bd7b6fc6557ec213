"""`python -m ortflow ...` and the `ortflow` command (a torchrun started by hand starts ranks this way)."""

import sys

from ortflow.run import rank_server


def main() -> None:
    """The `ortflow` command. One whose arguments ask for distributed=ddp first starts the process its ranks will be
    forked from (ortflow/run/rank_server.py), before this process imports torch: the two import side by side."""
    if rank_server.wanted(sys.argv[1:]):
        rank_server.start(["ortflow.cli.train", "ortflow.run.runner"])
    from ortflow.cli.train import main as command

    command()


if __name__ == "__main__":
    main()
