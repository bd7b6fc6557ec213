"""The compatibility layer: the only door to private torch and onnxruntime-training APIs, and what makes ORT 1.19.2
work on the torch releases after it. Supporting another torch or ORT version means revisiting this package only.

versions.py checks the versions the patches were written for before any is applied; torch_patches.py and
cpp_patches.py patch ORTModule's Python side and its C++ extensions' sources, each patch keyed on the torch versions
it is for; extensions.py builds those extensions once per machine; ortmodule_patches.py is what ortflow changes
inside ORTModule; ort.py and torch_onnx.py are the private ORT and exporter APIs the engines call; export_warnings.py
silences the warnings ortflow's exports trigger on purpose. Nothing here imports the graph work or the engines."""
