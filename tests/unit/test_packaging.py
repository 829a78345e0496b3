"""What the package carries besides code: its licence text and an SPDX licence, as installed."""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_package_carries_the_mit_licence_file() -> None:
    # The installed metadata in site-packages (the build's egg-info under src/ is on the test path too).
    (dist,) = importlib.metadata.distributions(name="onward", path=[sysconfig.get_paths()["purelib"]])
    assert dist.metadata["License-Expression"] == "MIT"
    (licence,) = [f for f in dist.files or [] if f.name == "LICENSE"]
    text = Path(str(licence.locate())).read_text()
    assert text == (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 the onward authors" in text
