"""Demo step 1 (CPU): generate a two-spirals classification data set as CSV.

Stands in for a lab's raw-data → shards step; deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
from pathlib import Path


def spirals(samples: int, seed: int, noise: float = 0.25) -> list[tuple[float, float, int]]:
    """Two interleaved spirals, one per class: learnable, but not linearly separable."""
    rng = random.Random(seed)  # noqa: S311 - reproducible data, not secrets
    points = []
    for i in range(samples):
        label = i % 2
        t = 0.5 + 3.5 * math.pi * rng.random()
        sign = 1.0 if label == 0 else -1.0
        x = sign * t * math.cos(t) / 4 + rng.gauss(0, noise)
        y = sign * t * math.sin(t) / 4 + rng.gauss(0, noise)
        points.append((x, y, label))
    rng.shuffle(points)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--out", type=Path, default=Path("dataset.csv"))
    args = parser.parse_args()
    points = spirals(args.samples, args.seed)
    test_from = int(len(points) * 0.8)
    with args.out.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["x", "y", "label", "split"])
        for i, (x, y, label) in enumerate(points):
            writer.writerow([f"{x:.6f}", f"{y:.6f}", label, "train" if i < test_from else "test"])
    print(f"wrote {len(points)} samples ({test_from} train, {len(points) - test_from} test) "
          f"to {args.out}")


if __name__ == "__main__":
    main()
