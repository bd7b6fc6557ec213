"""Training artifacts a user can ship to a device (`ortflow-export-artifacts`, `export.device=true`): a trained run
re-exported through the artifacts engine with the portable settings (portable.py), its manifest, an example batch,
a check where torch is absent, the browser page and the way back to a torch state_dict.

Nothing here is imported by the torch-free check (torch_free.py and serve.py run as scripts of their own).
"""
