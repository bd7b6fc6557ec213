"""`ortflow-check`'s work: every accel mode tried for a few steps on one model (modes.py), each engine's verdict
against eager's own noise (parity.py), and the table it prints (table.py).
The command line is `ortflow/cli/check.py`."""
