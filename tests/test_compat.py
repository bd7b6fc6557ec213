"""compat.py knows the versions it was written for: an unknown combination is refused in one paragraph (before any
patch or export), unless the documented override is set."""

import pytest

from ortflow.accel import compat
from ortflow.errors import OrtflowError


def test_the_installed_stack_is_supported():
    assert compat.untested_versions() == {}
    compat.require_supported_versions()


@pytest.mark.parametrize("torch_version", ["2.3.1", "2.7.0+cpu", "3.0.0"])
def test_an_unknown_torch_is_refused_naming_installed_and_supported(monkeypatch, torch_version):
    installed = {**compat.installed_versions(), "torch": torch_version}
    monkeypatch.setattr(compat, "installed_versions", lambda: installed)
    monkeypatch.delenv(compat.ALLOW_UNTESTED, raising=False)
    with pytest.raises(OrtflowError) as refused:
        compat.require_supported_versions()
    message = str(refused.value)
    assert f"torch {torch_version}" in message and "torch 2.4 to 2.6" in message and compat.ALLOW_UNTESTED in message
    assert "\n" not in message
    monkeypatch.setenv(compat.ALLOW_UNTESTED, "1")
    compat.require_supported_versions()  # the override lets a user try anyway
    assert compat.untested_versions() == {"torch": torch_version}
