"""Demo step 3 (GPU-light): evaluate the trained model on the held-out split."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from m27.demo._data import load

try:
    import torch
except ImportError:  # pragma: no cover - depends on the installation
    print("the demo's analysis step needs torch: pip install torch==2.13.0", file=sys.stderr)
    raise SystemExit(2) from None

from m27.demo.train import model, pick_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("analysis.json"))
    args = parser.parse_args()
    device = pick_device()
    features, labels = load(args.data, "test")
    net = model().to(device)
    net.load_state_dict(torch.load(args.model, map_location=device))
    net.eval()
    with torch.no_grad():
        predicted = net(torch.tensor(features, device=device)).argmax(1).tolist()
    confusion = [[0, 0], [0, 0]]
    for truth, guess in zip(labels, predicted, strict=True):
        confusion[truth][guess] += 1
    accuracy = sum(confusion[i][i] for i in range(2)) / max(1, len(labels))
    result = {"test_samples": len(labels), "accuracy": accuracy, "confusion": confusion}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"test accuracy {accuracy:.3f} on {len(labels)} samples")
    print(f"confusion matrix (rows: truth, columns: predicted): {confusion}")


if __name__ == "__main__":
    main()
