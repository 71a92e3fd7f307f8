"""Every exception m27 defines is an M27Error: a shell that catches M27Error at its boundary
catches every one of them (and shows a sentence, not a traceback)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import m27
from m27.common.errors import M27Error


def test_every_exception_class_of_m27_is_under_m27error() -> None:
    outside = []
    for info in pkgutil.walk_packages(m27.__path__, "m27."):
        if ".tests" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, BaseException)
                    and value.__module__ == info.name and not issubclass(value, M27Error)):
                outside.append(f"{info.name}.{name}")
    assert outside == []
