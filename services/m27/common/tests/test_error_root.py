"""Every exception m27 defines is an M27Error: a shell that catches M27Error at its boundary
catches every one of them (and shows a sentence, not a traceback), and each one's family
says which gRPC status a server answers with."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import grpc
import pytest

import m27
from m27.common import errors
from m27.common.errors import M27Error
from m27.common.grpc_server import status_of


def m27_exceptions() -> list[type[BaseException]]:
    found: list[type[BaseException]] = []
    for info in pkgutil.walk_packages(m27.__path__, "m27."):
        if ".tests" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        found.extend(value for value in vars(module).values()
                     if inspect.isclass(value) and issubclass(value, BaseException)
                     and value.__module__ == info.name)
    return found


def test_every_exception_class_of_m27_is_under_m27error() -> None:
    outside = [f"{cls.__module__}.{cls.__qualname__}" for cls in m27_exceptions()
               if not issubclass(cls, M27Error)]
    assert outside == []


def test_every_error_class_names_a_real_grpc_status() -> None:
    wrong = [f"{cls.__module__}.{cls.__qualname__}: {cls.status!r}" for cls in m27_exceptions()
             if issubclass(cls, M27Error) and cls.status not in grpc.StatusCode.__members__]
    assert wrong == []


@pytest.mark.parametrize(("error", "code"), [
    (errors.InvalidRequest("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFoundError("x"), grpc.StatusCode.NOT_FOUND),
    (errors.Refused("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.BusError("x"), grpc.StatusCode.UNAVAILABLE),
    (errors.DataLoss("x"), grpc.StatusCode.DATA_LOSS),
    (errors.Internal("x"), grpc.StatusCode.INTERNAL),
    (errors.OutOfRange("x"), grpc.StatusCode.OUT_OF_RANGE),
    (M27Error("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (ValueError("a bug of ours"), grpc.StatusCode.INTERNAL),
])
def test_one_mapping_from_errors_to_statuses(error: BaseException,
                                              code: grpc.StatusCode) -> None:
    assert status_of(error) == code
