"""Exact resume of a Hugging Face `transformers.Trainer` run through
m27.train.huggingface.M27Callback: a run SIGKILLed at a random step and resumed in a
fresh process with `trainer.train(resume_from_checkpoint=ckpt.resume_dir())` ends with
parameters, optimizer state, LR schedule, the Trainer's step and epoch and the RNG
states bitwise identical to a run never interrupted (CPU, a tiny BERT with dropout built
from a config: nothing is downloaded); SIGTERM checkpoints the step it is at, then stops.

The program (`python tests/test_huggingface_resume.py DIR STEPS`) trains with the
Trainer's own shuffling sampler, AdamW, a linear schedule with warm-up, epochs of 12
steps, and a checkpoint every 2 steps.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from m27.common.checkpoint_storage import LocalStore
from tests.test_train_resume import assert_bitwise_equal, run_program

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

STEPS = 40
WORKER = Path(__file__).resolve()


def train(out: Path, steps: int) -> None:
    """The training program; prints `step N` after each optimizer step."""
    import logging
    import time
    import warnings

    import numpy as np
    import transformers
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from m27.train.huggingface import M27Callback

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    slow_after = int(os.environ.get("M27_TEST_SLOW_AFTER") or 0)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 64, (96, 12), generator=generator)
    labels = torch.randint(0, 4, (96,), generator=generator)
    data = [{"input_ids": tokens[i], "attention_mask": torch.ones(12, dtype=torch.long),
             "labels": labels[i]} for i in range(96)]
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16,
        hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.1)
    config.num_labels = 4
    model = BertForSequenceClassification(config)
    ckpt = M27Callback(every_steps=2, store=out / "store", signal=False)

    class Report(TrainerCallback):
        durable: int | None = 0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            print(f"step {state.global_step}", flush=True)
            latest = ckpt.checkpointer.latest if ckpt.checkpointer else None
            if latest is not None and latest.step != self.durable:
                self.durable = latest.step
                print(f"durable {latest.step}", flush=True)
            late = slow_after and state.global_step >= slow_after
            time.sleep(0.2 if late else 0.01)

    args = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=8, max_steps=steps,
        learning_rate=5e-3, warmup_steps=4, lr_scheduler_type="linear", weight_decay=0.01,
        save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    report = Report()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ckpt, report])
    resume = ckpt.resume_dir()
    resumed = 0
    if resume is not None:
        import json
        resumed = json.loads((Path(resume) / "trainer_state.json").read_text())["global_step"]
    report.durable = resumed
    print(f"resumed {resumed}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    assert resume is None or not Path(resume).exists(), "the resume directory is left"
    assert trainer.optimizer is not None
    assert trainer.lr_scheduler is not None
    torch.save({"model": model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                "scheduler": trainer.lr_scheduler.state_dict(),
                "state": {"global_step": trainer.state.global_step,
                          "epoch": trainer.state.epoch},
                "torch_rng": torch.get_rng_state(),
                "numpy_rng": np.random.get_state(legacy=False)["state"]["key"],
                "python_rng": random.getstate()}, out / "final.pt")


def run(out: Path, kill_at: int | None = None, how: signal.Signals = signal.SIGKILL
        ) -> tuple[bool, int]:
    return run_program(WORKER, out, STEPS, kill_at, how)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("uninterrupted")
    assert run(out)[0]
    result: dict[str, Any] = torch.load(out / "final.pt", weights_only=False)
    return result


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_trainer_run_killed_at_a_random_step_resumes_bitwise_identically(
        seed: int, tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    rng = random.Random(seed)
    kills = sorted(rng.sample(range(2, STEPS - 2), 2 if seed == 3 else 1))  # seed 3: twice
    starts = [run(tmp_path, kill_at)[1] for kill_at in kills]
    finished, resumed_from = run(tmp_path)
    assert finished
    assert 0 < resumed_from < STEPS, "the last run resumed from a checkpoint"
    assert starts[0] == 0
    assert starts == sorted(starts)
    resumed = torch.load(tmp_path / "final.pt", weights_only=False)
    assert resumed["state"]["global_step"] == STEPS
    assert_bitwise_equal(resumed, uninterrupted)


@pytest.mark.parametrize("signal_at", [11, 13])
def test_sigterm_checkpoints_the_step_then_stops_and_nothing_is_redone(
        signal_at: int, tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    """At 11 the stop is served at step 12, the end of the first epoch; at 13 within the
    second."""
    assert not run(tmp_path, signal_at, signal.SIGTERM)[0]
    last = LocalStore(tmp_path / "store").latest("local")
    assert last is not None
    assert last.step is not None
    assert last.metadata["reason"] == "signal SIGTERM (stopping)"
    finished, resumed_from = run(tmp_path)
    assert finished
    assert resumed_from == last.step >= signal_at + 1
    resumed = torch.load(tmp_path / "final.pt", weights_only=False)
    assert_bitwise_equal(resumed, uninterrupted)


if __name__ == "__main__":
    train(Path(sys.argv[1]), int(sys.argv[2]))
