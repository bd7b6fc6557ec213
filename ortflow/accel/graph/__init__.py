"""The graph work: what ortflow does to the ONNX graphs the ORT engines train, between torch's export and ORT's
gradient builder. Graph rewrites and decompositions of ops ORT cannot differentiate (rewrites.py,
decompositions.py, activations.py), ortflow's export symbolics (symbolics.py), operators torch runs inside ORT's
graphs as ATen nodes (aten_*.py), dropout masks fed as inputs (fed_dropout.py) and BatchNorm's running statistics
(batchnorm.py).

It imports the compatibility layer (accel/compat/) and nothing of the engines above it."""
