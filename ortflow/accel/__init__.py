"""Acceleration engines: `none` (eager PyTorch), `ortmodule` and `artifacts`, behind one Engine protocol."""
