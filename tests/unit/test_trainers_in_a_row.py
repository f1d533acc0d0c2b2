"""Trainers one after another in one process leave nothing behind that grows with them."""

from __future__ import annotations

import json
from pathlib import Path

from distzo.config.job import resolve
from distzo.job.trainer import Trainer


def _built_tokenizer(tmp_path: Path, name: str, data: Path) -> object:
    flags = ["--task", "sst2", "--train-file", str(data), "--eval-file", str(data)]
    flags += ["--max-steps", "1", "--batch-size", "2", "--device", "cpu"]
    with Trainer(resolve([*flags, "--output-dir", str(tmp_path / name)])) as trainer:
        trainer.build()
        return trainer.tokenizer


def test_prompt_task_trainers_in_a_row_encode_with_one_byte_tokenizer(tmp_path):
    """A tokenizers tokenizer that has encoded text keeps native memory once dropped: a
    fresh byte tokenizer per run grew a notebook's process by 23 MB a Trainer on the SST-2
    sample. The runs of a process share one."""
    data = tmp_path / "sst2.jsonl"
    data.write_text((json.dumps({"sentence": "a gripping film", "label": 1}) + "\n") * 4)
    first = _built_tokenizer(tmp_path, "a", data)
    assert _built_tokenizer(tmp_path, "b", data) is first
