"""`--secret NAME[=VALUE]`: from the environment by default, so a value need not be typed
where the shell's history and the process list keep it."""

from __future__ import annotations

import pytest

from m27.cli._common import parse_secrets
from m27.common.errors import M27Error


def test_a_name_alone_reads_the_environment_and_a_pair_is_taken_as_given() -> None:
    assert parse_secrets(["WANDB", "HF=hf_x=y", "EMPTY="], {"WANDB": "w"}) == {
        "WANDB": "w", "HF": "hf_x=y", "EMPTY": ""}


def test_an_unset_variable_or_no_name_is_a_clear_error() -> None:
    with pytest.raises(M27Error, match="the environment variable WANDB is not set"):
        parse_secrets(["WANDB"], {})
    with pytest.raises(M27Error, match="--secret expects NAME"):
        parse_secrets(["=value"], {})
