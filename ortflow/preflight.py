"""Check the YAML files a command line selects before Hydra reads them.

Hydra reports a YAML syntax error (a tab, an unclosed bracket, a duplicate key) as a long internal traceback, and a
recipe without its `# @package _global_` header as an unknown `recipe` key. This pre-flight finds the file each
`group=option` override selects, in the search path the command line sets, and reports such problems as one
paragraph naming the file and line; an override Hydra's lexer would refuse is named with the quoting that works.
"""

import re
from pathlib import Path

from omegaconf import OmegaConf

from ortflow.errors import ConfigError
from ortflow.paths import config_dir, search_dirs

_OVERRIDE = re.compile(r"^[+~]{0,2}(?P<group>[A-Za-z_][\w/]*)=(?P<option>[\w.-]+)$")


def _search_dirs(args: list[str]) -> list[Path]:
    return [config_dir(), *search_dirs(args)]


def _check_syntax(args: list[str]) -> None:
    """Hydra's override lexer refuses unquoted characters outside its grammar (a non-ASCII letter, a space, a
    bracket) with a raw lexer message; name the override and show the quoting that works instead."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            parser.parse_overrides([arg])
        except OverrideParseException:
            key, _, value = arg.partition("=")
            raise ConfigError(
                f"the override {arg!r} cannot be read: Hydra's override grammar needs this value quoted (non-ASCII "
                f"letters, brackets, quotes and some symbols are refused unquoted). Quote the value inside the "
                f"shell's quotes: '{key}=\"{value}\"' (in "
                f"Python: \"{key}='{value}'\")."
            ) from None


def check(args: list[str]) -> None:
    """Raise ConfigError for an override Hydra cannot parse, or the first selected config file that is not valid
    YAML (or a headerless recipe)."""
    _check_syntax(args)
    dirs = _search_dirs(args)
    for arg in args:
        match = _OVERRIDE.match(arg)
        if not match or match["group"].startswith("hydra"):
            continue
        for directory in dirs:
            file = directory / match["group"] / f"{match['option']}.yaml"
            if file.is_file():
                _check_file(file, match["group"])
                break


def _check_file(file: Path, group: str) -> None:
    try:
        OmegaConf.load(file)
    except Exception as err:  # yaml's scanner/parser/constructor errors, OmegaConf's duplicate keys
        problem = " ".join(line.strip() for line in str(err).splitlines() if line.strip() and str(file) not in line)
        where = re.search(r"line (\d+), column (\d+)", str(err))
        at = f" at line {where[1]}, column {where[2]}" if where else ""
        raise ConfigError(
            f"{group} file '{file}' is not valid YAML{at}: {problem}. Fix the file and run again."
        ) from None
    if group == "recipe" and "@package _global_" not in file.read_text().split("\n", 1)[0]:
        raise ConfigError(
            f"recipe file '{file}' must start with the line '# @package _global_' (a recipe overrides the whole "
            "config; without the header its keys would land under `recipe.`). Add it as the first line."
        )
