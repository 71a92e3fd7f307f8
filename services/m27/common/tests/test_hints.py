"""The hints of error messages: a close match, else the choices (bounded)."""

from __future__ import annotations

from m27.common.hints import did_you_mean, one_of


def test_a_close_match_is_suggested_and_a_far_one_lists_the_choices() -> None:
    assert did_you_mean("trian", ["prepare", "train"]) == "did you mean `train`?"
    assert did_you_mean("zzz", ["prepare", "train"]) == ""
    assert one_of("trian", ["prepare", "train"], "its steps") == "did you mean `train`?"
    assert one_of("zzz", ["prepare", "train"], "its steps") == "its steps: prepare, train"
    assert one_of("zzz", []) == ""
    many = [f"s{i:02}" for i in range(25)]
    assert one_of("zzz", many, shown=3) == "known: s00, s01, s02 and 22 more"
