"""A node's GPU platform — driver, CUDA and NVML versions, GPU models — and what a step may
require of it (pure: the pipeline parser, the scheduler, `m27 plan`, `m27 nodes` and
`m27 status` all decide with these functions).

Versions compare as dotted numbers: 535.104.05 < 550.54.15, 12.10 > 12.9, 12.1 == 12.1.0.
A requirement is an operator and a version — `>=12.1`, `==550.54.15`, `<13`, `!=12.2` — and
a bare version means "at least" (`12.1` is `>=12.1`). A node whose version is unknown (no
GPU, no NVML, a simulated GPU given no version) meets no requirement on it.

GPU models match by words: every word of the requirement must be a word of the GPU's
name, case aside. `A100` matches "NVIDIA A100-SXM4-80GB" but not "NVIDIA A10G";
`A100 80GB` matches the 80 GB boards only; `A100|H100` is either.

Nodes of one lab are meant to run one driver and one CUDA version: `differences` names
the nodes that differ from the most common one (what `m27 status` shows and the scheduler
reports as a `NodePlatformDiffers` event).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Literal

import msgspec

from m27.common.errors import InvalidRequest

#: The `resources:` keys that constrain where a step runs, and what each compares.
VersionKey = Literal["driver", "cuda"]
VERSION_KEYS: Final[tuple[VersionKey, ...]] = ("driver", "cuda")
MAX_REQUIREMENT_CHARS: Final = 200

_OPERATORS: Final = (">=", "<=", "==", "!=", ">", "<")
_VERSION = re.compile(r"\d+(?:\.\d+){0,5}")
_WORD = re.compile(r"[a-z0-9]+")


class Platform(msgspec.Struct, frozen=True, kw_only=True):
    """What a node-agent found at start ("" where it could not tell)."""

    driver: str = ""  # e.g. "550.54.15" (nvmlSystemGetDriverVersion)
    cuda: str = ""  # the newest CUDA the driver supports, e.g. "12.4"
    nvml: str = ""  # e.g. "12.550.54.15"

    def version(self, key: VersionKey) -> str:
        return self.driver if key == "driver" else self.cuda


class PlatformError(InvalidRequest, ValueError):
    """A requirement that cannot be understood; the message says what is accepted."""


# ---------------------------------------------------------------- versions


def parse_version(text: str) -> tuple[int, ...] | None:
    """`550.54.15` → (550, 54, 15); None for anything that is not dotted numbers."""
    cleaned = text.strip()
    if not _VERSION.fullmatch(cleaned):
        return None
    return tuple(int(part) for part in cleaned.split("."))


def cuda_from_nvml(value: int) -> str:
    """NVML's CUDA driver version (12040) as users write it ("12.4")."""
    return f"{value // 1000}.{value % 1000 // 10}"


class VersionRequirement(msgspec.Struct, frozen=True):
    operator: str
    version: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.operator}{'.'.join(map(str, self.version))}"


def parse_requirement(text: str, key: str) -> VersionRequirement:
    """`>=12.1` / `12.1` (at least) / `==550.54.15` …; PlatformError naming `key`."""
    if len(text) > MAX_REQUIREMENT_CHARS:
        raise PlatformError(f"{key} requirement is {len(text)} characters; at most "
                            f"{MAX_REQUIREMENT_CHARS}")
    stripped = text.strip()
    operator = next((op for op in _OPERATORS if stripped.startswith(op)), "")
    version = parse_version(stripped[len(operator):])
    if version is None:
        raise PlatformError(
            f"{key} requirement {text!r} is not understood: expected a version with an "
            f"optional operator ({', '.join(_OPERATORS)}), e.g. \">=12.1\" or \"550.54\"")
    return VersionRequirement(operator or ">=", version)


def _compare(have: tuple[int, ...], want: tuple[int, ...]) -> int:
    width = max(len(have), len(want))
    left = have + (0,) * (width - len(have))
    right = want + (0,) * (width - len(want))
    return (left > right) - (left < right)


def satisfies(version: str, requirement: VersionRequirement) -> bool:
    """Whether a node's `version` meets `requirement`; an unknown version never does."""
    have = parse_version(version)
    if have is None:
        return False
    order = _compare(have, requirement.version)
    match requirement.operator:
        case ">=":
            return order >= 0
        case "<=":
            return order <= 0
        case ">":
            return order > 0
        case "<":
            return order < 0
        case "==":
            return order == 0
        case _:
            return order != 0


# ---------------------------------------------------------------- GPU models


def _words(text: str) -> frozenset[str]:
    return frozenset(_WORD.findall(text.lower()))


def model_alternatives(text: str) -> tuple[str, ...]:
    """`A100|H100` → ("A100", "H100"); PlatformError for one with no word in it."""
    if len(text) > MAX_REQUIREMENT_CHARS:
        raise PlatformError(f"gpu_model is {len(text)} characters; at most "
                            f"{MAX_REQUIREMENT_CHARS}")
    alternatives = tuple(part.strip() for part in text.split("|"))
    for part in alternatives:
        if not _words(part):
            raise PlatformError(
                f"gpu_model {text!r} is not understood: expected model names separated by "
                "'|', e.g. \"A100\" or \"A100|H100\"")
    return alternatives


def model_matches(name: str, wanted: str) -> bool:
    """Whether a GPU called `name` is the model `wanted` (one alternative): every word of
    `wanted` is a word of `name`."""
    words = _words(wanted)
    return bool(words) and words <= _words(name)


def any_model_matches(name: str, alternatives: Iterable[str]) -> bool:
    return any(model_matches(name, wanted) for wanted in alternatives)


# ---------------------------------------------------------------- requirements of a step


class Requirements(msgspec.Struct, frozen=True, kw_only=True):
    """What a step asks of a node beyond capacity ("" : no requirement), as written."""

    gpu_model: str = ""
    driver: str = ""
    cuda: str = ""

    def __bool__(self) -> bool:
        return bool(self.gpu_model or self.driver or self.cuda)

    def versions(self) -> tuple[tuple[VersionKey, VersionRequirement], ...]:
        found: list[tuple[VersionKey, VersionRequirement]] = []
        if self.driver:
            found.append(("driver", parse_requirement(self.driver, "driver")))
        if self.cuda:
            found.append(("cuda", parse_requirement(self.cuda, "cuda")))
        return tuple(found)

    def text(self) -> str:
        """E.g. "GPU model A100, cuda >=12.1"."""
        parts = [f"GPU model {self.gpu_model}"] if self.gpu_model else []
        parts += [f"{key} {requirement}" for key, requirement in self.versions()]
        return ", ".join(parts)


def check_requirements(gpu_model: str, driver: str, cuda: str) -> Requirements:
    """The requirements as a pipeline states them, validated (PlatformError on bad ones)."""
    requirements = Requirements(gpu_model=gpu_model.strip(), driver=driver.strip(),
                                cuda=cuda.strip())
    if requirements.gpu_model:
        model_alternatives(requirements.gpu_model)
    requirements.versions()
    return requirements


def platform_fits(platform: Platform, requirements: Requirements) -> bool:
    """Whether a node's driver and CUDA meet `requirements` (GPU models are per GPU)."""
    return all(satisfies(platform.version(key), requirement)
               for key, requirement in requirements.versions())


def platform_misses(platform: Platform, requirements: Requirements) -> str:
    """What of `requirements` a node's platform misses, e.g. "cuda 12.0, needs >=12.1"."""
    misses = [f"{key} {platform.version(key) or 'unknown'}, needs {requirement}"
              for key, requirement in requirements.versions()
              if not satisfies(platform.version(key), requirement)]
    return "; ".join(misses)


def node_misses(gpu_names: Sequence[str], platform: Platform, needs: Requirements,
                gpus: int = 1) -> str:
    """What of `needs` a node misses, e.g. "GPUs NVIDIA A10G; cuda 12.0, needs >=12.1"
    (fewer than `gpus` GPUs of the model, then its driver and CUDA); "" when it meets them."""
    why = []
    if needs.gpu_model:
        alternatives = model_alternatives(needs.gpu_model)
        if sum(1 for name in gpu_names if any_model_matches(name, alternatives)) < gpus:
            why.append(f"GPUs {', '.join(sorted(set(gpu_names))) or 'none'}")
    why.append(platform_misses(platform, needs))
    return "; ".join(w for w in why if w)


# ---------------------------------------------------------------- uniformity across nodes


def _reference(values: Mapping[str, str]) -> str:
    """The most common known value; a tie goes to the newest version."""
    counts = Counter(v for v in values.values() if v)
    return max(counts, key=lambda v: (counts[v], parse_version(v) or (), v))


def differences(platforms: Mapping[str, Platform]) -> dict[str, tuple[str, ...]]:
    """Per node whose driver or CUDA differs from most nodes': what differs, e.g.
    ("driver 535.104.05, most nodes 550.54.15 (2 of 3)",). Nodes that do not know a
    version are left out of its comparison; with one known value there is nothing to say."""
    found: dict[str, list[str]] = {}
    for key in VERSION_KEYS:
        known = {node: v for node, p in platforms.items() if (v := p.version(key))}
        if len(set(known.values())) < 2:
            continue
        reference = _reference(known)
        agreeing = sum(1 for v in known.values() if v == reference)
        for node, value in sorted(known.items()):
            if value != reference:
                found.setdefault(node, []).append(
                    f"{key} {value}, most nodes {reference} ({agreeing} of {len(known)})")
    return {node: tuple(lines) for node, lines in sorted(found.items())}


def summary(found: Mapping[str, Sequence[str]]) -> str:
    """One line for `m27 status`: "node-3: driver 535.104.05, most nodes 550.54.15 …"."""
    return "; ".join(f"{node}: {', '.join(lines)}" for node, lines in found.items())
