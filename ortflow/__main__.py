from ortflow.cli import main

main()
