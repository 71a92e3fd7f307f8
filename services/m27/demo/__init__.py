"""The demo pipeline behind `m27 demo`: real data preparation, real torch training, analysis.

Its steps run `"$M27_PYTHON" -m m27.demo.<step>`: the node-agent sets M27_PYTHON to the
interpreter m27 runs in, so the steps find m27 and torch without any PATH set-up.
"""

from __future__ import annotations

from importlib import resources


def demo_pipeline(*, epochs: int = 8, samples: int = 4000, seed: int = 27,
                  spike_epoch: int = 0) -> tuple[str, dict[str, str]]:
    """The bundled pipeline YAML and the variables to submit it with (`spike_epoch`: the
    training step's learning-rate blunder, which its training monitor catches; 0: none)."""
    text = resources.files("m27.demo").joinpath("pipeline.yaml").read_text(encoding="utf-8")
    return text, {"EPOCHS": str(epochs), "SAMPLES": str(samples), "SEED": str(seed),
                  "SPIKE_EPOCH": str(spike_epoch)}
