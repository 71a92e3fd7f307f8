"""The folder is the package: m27 lives in services/m27 and is importable under one name
only (issue 13). Collected with the rest of the suite, so any test module pytest imported
under another name would show here."""

from __future__ import annotations

import sys
from pathlib import Path

import m27


def test_m27_is_the_folder_services_m27() -> None:
    where = Path(m27.__file__).resolve().parent
    assert (where.name, where.parent.name) == ("m27", "services")
    assert not (where.parent / "__init__.py").exists()  # services/ is no package


def test_nothing_of_m27_is_imported_under_a_second_name() -> None:
    assert __name__ == "m27.common.tests.test_layout"
    twice = sorted(name for name in sys.modules
                   if name == "services" or name.startswith("services."))
    assert twice == []
