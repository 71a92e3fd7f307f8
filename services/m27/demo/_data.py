"""Reading the demo data set (shared by the training and analysis steps)."""

from __future__ import annotations

import csv
from pathlib import Path


def load(path: Path, split: str) -> tuple[list[list[float]], list[int]]:
    features, labels = [], []
    with path.open(newline="") as file:
        for row in csv.DictReader(file):
            if row["split"] == split:
                features.append([float(row["x"]), float(row["y"])])
                labels.append(int(row["label"]))
    return features, labels
