"""Run one of ORT's extension setup.py files as a unity build without debug info (used by extensions.py).

`python -m ortflow.accel.compat.extension_setup SETUP_PY build` runs SETUP_PY with torch's CppExtension wrapped: an
extension's sources are compiled as one translation unit (a file that #includes them all, so the torch headers,
which dominate the compile time, are parsed once) and `-g0` follows the flags Python's build configuration
brings (`-g`). Everything else (names, include dirs, ORT's own flags) is the setup.py's own.
"""

import runpy
import sys
from pathlib import Path

from torch.utils import cpp_extension

NO_DEBUG_INFO = "-g0"


def unity_source(name: str, sources: list[str]) -> str:
    """Write `<name>_unity.cc` beside the first source, #including every source; returns its path."""
    unit = Path(sources[0]).resolve().parent / f"{name}_unity.cc"
    unit.write_text("".join(f'#include "{Path(source).resolve()}"\n' for source in sources))
    return str(unit)


def _with_flag(extra: dict | list | None, flag: str) -> dict | list:
    if isinstance(extra, dict):
        return {**extra, "cxx": [*extra.get("cxx", []), flag]}
    return [*(extra or []), flag]


def _unity_extension(original):
    def build(name: str, sources: list[str], *args, **kwargs):
        if len(sources) > 1:
            sources = [unity_source(name, sources)]
        kwargs["extra_compile_args"] = _with_flag(kwargs.get("extra_compile_args"), NO_DEBUG_INFO)
        return original(name, sources, *args, **kwargs)

    return build


def main() -> None:
    setup_py, *arguments = sys.argv[1:]
    cpp_extension.CppExtension = _unity_extension(cpp_extension.CppExtension)
    sys.argv = [setup_py, *arguments]
    runpy.run_path(setup_py, run_name="__main__")


if __name__ == "__main__":
    main()
