"""Driver/CUDA versions, requirements and GPU model words (m27.common.platform)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.common.platform import (
    Platform,
    PlatformError,
    Requirements,
    check_requirements,
    cuda_from_nvml,
    differences,
    model_alternatives,
    model_matches,
    parse_requirement,
    parse_version,
    platform_fits,
    platform_misses,
    satisfies,
)

versions = st.lists(st.integers(0, 999), min_size=1, max_size=4).map(
    lambda parts: ".".join(map(str, parts)))


def test_versions_compare_as_numbers_not_text() -> None:
    assert satisfies("12.10", parse_requirement(">=12.9", "cuda"))
    assert satisfies("550.54.15", parse_requirement(">535.104.05", "driver"))
    assert not satisfies("535.104.05", parse_requirement("550", "driver"))  # bare: at least
    assert satisfies("12.1.0", parse_requirement("==12.1", "cuda"))
    assert satisfies("12.2", parse_requirement("!=12.1", "cuda"))
    assert satisfies("11.8", parse_requirement("<12", "cuda"))
    assert satisfies("12", parse_requirement("<=12.0.0", "cuda"))


def test_an_unknown_version_meets_no_requirement() -> None:
    for op in (">=", "<=", "==", "!=", ">", "<"):
        assert not satisfies("", parse_requirement(f"{op}1", "cuda"))
    assert not platform_fits(Platform(), Requirements(cuda=">=1"))
    assert platform_fits(Platform(), Requirements(gpu_model="A100"))  # models are per GPU
    assert platform_misses(Platform(cuda="12.0"), Requirements(cuda=">=12.1", driver="535")) \
        == "driver unknown, needs >=535; cuda 12.0, needs >=12.1"


@pytest.mark.parametrize("text", ["", ">=", "12.x", "=>12", ">= twelve", "12..1", "v12",
                                  "1\x00", "1" * 300, ">=12.1; rm -rf /"])
def test_bad_requirements_are_refused_with_what_is_accepted(text: str) -> None:
    with pytest.raises(PlatformError, match="cuda"):
        parse_requirement(text, "cuda")


@given(versions, versions)
def test_exactly_one_order_holds_and_the_operators_agree(a: str, b: str) -> None:
    def holds(op: str) -> bool:
        return satisfies(a, parse_requirement(f"{op}{b}", "v"))

    assert [holds("<"), holds("=="), holds(">")].count(True) == 1
    assert holds(">=") == (holds(">") or holds("=="))
    assert holds("<=") == (holds("<") or holds("=="))
    assert holds("!=") == (not holds("=="))
    assert holds(">=") == satisfies(a, parse_requirement(b, "v"))  # bare is "at least"


@given(st.text(max_size=60))
def test_any_text_is_a_version_or_none_and_never_raises(text: str) -> None:
    parsed = parse_version(text)
    assert parsed is None or all(isinstance(p, int) for p in parsed)
    try:
        requirement = parse_requirement(text, "cuda")
    except PlatformError as exc:
        message = str(exc)
    else:  # what was understood reads back as an operator and that version
        message = f"cuda {requirement}"
        assert parse_version(str(requirement).lstrip("<>=!")) == requirement.version
    assert message.startswith("cuda")


def test_nvml_cuda_numbers_read_as_users_write_them() -> None:
    assert cuda_from_nvml(12040) == "12.4"
    assert cuda_from_nvml(11080) == "11.8"
    assert cuda_from_nvml(12100) == "12.10"


def test_gpu_models_match_by_words() -> None:
    name = "NVIDIA A100-SXM4-80GB"
    assert model_matches(name, "A100")
    assert model_matches(name, "a100 80gb")
    assert not model_matches(name, "A10")
    assert not model_matches("NVIDIA A10G", "A10")  # "A10G" is one word
    assert model_matches("NVIDIA A10", "A10")
    assert not model_matches(name, "A100 40GB")
    assert model_matches("V100M16", "V100M16")
    assert not model_matches("V100M32", "V100M16")
    assert model_matches("m27 simulated GPU (A100)", "A100")
    assert model_alternatives("A100 | H100") == ("A100", "H100")
    with pytest.raises(PlatformError, match="gpu_model"):
        model_alternatives("A100||")
    with pytest.raises(PlatformError, match="gpu_model"):
        model_alternatives("-")


@given(st.text(max_size=40), st.text(max_size=40))
def test_a_model_matches_a_name_it_is_part_of(prefix: str, wanted: str) -> None:
    if any(ch.isalnum() and ch.isascii() for ch in wanted):
        assert model_matches(f"{prefix} {wanted}", wanted)


def test_requirements_are_checked_as_written() -> None:
    needs = check_requirements(" A100|H100 ", "", ">=12.1")
    assert needs == Requirements(gpu_model="A100|H100", cuda=">=12.1")
    assert needs.text() == "GPU model A100|H100, cuda >=12.1"
    assert not Requirements()
    with pytest.raises(PlatformError, match="driver"):
        check_requirements("", "latest", "")


def test_the_nodes_that_differ_from_most_are_named() -> None:
    same = Platform(driver="550.54.15", cuda="12.4")
    old = Platform(driver="535.104.05", cuda="12.2")
    found = differences({"n1": same, "n2": same, "n3": old, "cpu": Platform()})
    assert found == {"n3": ("driver 535.104.05, most nodes 550.54.15 (2 of 3)",
                            "cuda 12.2, most nodes 12.4 (2 of 3)")}
    assert differences({"n1": same, "n2": same, "cpu": Platform()}) == {}
    # a tie: the newer version is the reference
    assert set(differences({"a": same, "b": old})) == {"b"}


@given(st.dictionaries(st.sampled_from([f"n{i}" for i in range(8)]),
                       st.builds(Platform, driver=st.sampled_from(["", "535.1", "550.2"]),
                                 cuda=st.sampled_from(["", "12.2", "12.4"]))))
def test_differences_leave_the_majority_alone(platforms: dict[str, Platform]) -> None:
    found = differences(platforms)
    for key in ("driver", "cuda"):
        known = [getattr(p, key) for p in platforms.values() if getattr(p, key)]
        flagged = [n for n, lines in found.items()
                   if any(line.startswith(key) for line in lines)]
        if len(set(known)) < 2:
            assert not flagged
        else:  # at most the nodes outside the most common value, never all of them
            most = max(known.count(v) for v in set(known))
            assert len(flagged) == len(known) - most


def test_what_a_node_misses_in_words() -> None:
    from m27.common.platform import node_misses

    needs = Requirements(gpu_model="A100", cuda=">=12.1")
    assert node_misses(["NVIDIA A10G"] * 2, Platform(cuda="12.0"), needs) == \
        "GPUs NVIDIA A10G; cuda 12.0, needs >=12.1"
    assert node_misses(["NVIDIA A100-SXM4-80GB"], Platform(cuda="12.4"), needs) == ""
    assert node_misses(["NVIDIA A100-SXM4-80GB"], Platform(cuda="12.4"), needs, gpus=2) == \
        "GPUs NVIDIA A100-SXM4-80GB"
