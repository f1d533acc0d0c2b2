"""One object per kind of task: training batches by step, and its evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from distzo.data.loaders import load_rows
from distzo.data.prompt_data import PromptEncoder, PromptTrainData, TextTrainData
from distzo.data.synthetic import CountingTask
from distzo.data.tasks import TASKS, Example, build_examples, get_task

GENERATED = ("counting",)
TEXT = ("text",)
TASK_NAMES = GENERATED + TEXT + tuple(TASKS)


class TaskData(Protocol):
    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]: ...

    def evaluate(self, engine, parallel) -> dict[str, float]: ...

    @property
    def longest(self) -> int:
        """The longest token sequence a step or an evaluation will run (the memory plan's)."""
        ...


@dataclass
class LoadedRows:
    """Training and evaluation material checked before any model is built."""

    task: str
    train: list[Any]  # Examples for prompt tasks, texts for the text task
    eval: list[Any]


def load_task_rows(task: str, train_file: str | None, eval_file: str | None) -> LoadedRows | None:
    """Read and check the files of a file-based task (one-line errors naming file and row)."""
    if task in GENERATED:
        if train_file or eval_file:
            raise ValueError(f"--task {task} generates its data; --train-file/--eval-file do not apply to it")
        return None
    if task not in TASK_NAMES:
        raise ValueError(f"unknown --task {task!r}; choose one of {', '.join(TASK_NAMES)}")
    if not train_file or not eval_file:
        raise ValueError(f"--task {task} reads its data: give --train-file and --eval-file")
    loaded = []
    for source in (train_file, eval_file):
        rows = load_rows(source)
        if not rows:
            raise ValueError(f"{source}: no rows")
        if task in TEXT:
            for number, row in enumerate(rows, 1):
                if not isinstance(row.get("text"), str):
                    raise ValueError(f"{source}, row {number}: missing column 'text' (task text needs text)")
            loaded.append([row["text"] for row in rows])
        else:
            loaded.append(build_examples(get_task(task), rows, source))
    return LoadedRows(task, loaded[0], loaded[1])


class CountingData:
    def __init__(self, vocab_size: int, seq_len: int, eval_size: int, seed: int, eval_batch_size: int) -> None:
        self.task = CountingTask(vocab_size, seq_len=seq_len, seed=seed)
        self.eval_set = self.task.eval_set(eval_size)
        self.longest = seq_len
        self.eval_batch_size = eval_batch_size

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        return self.task.batch(batch_size, step)

    def evaluate(self, engine, parallel) -> dict[str, float]:
        from distzo.evaluation import evaluate_lm

        return evaluate_lm(engine, self.eval_set, parallel, self.eval_batch_size)


class TextData:
    def __init__(self, rows: LoadedRows, encoder: PromptEncoder, seed: int, eval_batch_size: int) -> None:
        self.train = TextTrainData(rows.train, encoder, seed)
        self.eval_batch = encoder.collate([(ids, len(ids)) for ids, _ in (encoder.encode(t, "") for t in rows.eval)])
        self.eval_batch_size = eval_batch_size
        self.longest = max(max(len(ids) for ids, _ in self.train.sequences), self.eval_batch["input_ids"].shape[1])

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        return self.train.batch(batch_size, step)

    def evaluate(self, engine, parallel) -> dict[str, float]:
        from distzo.evaluation import evaluate_lm

        return evaluate_lm(engine, self.eval_batch, parallel, self.eval_batch_size)


class PromptData:
    def __init__(self, rows: LoadedRows, encoder: PromptEncoder, seed: int, eval_batch_size: int, max_new_tokens: int = 16) -> None:
        self.kind = TASKS[rows.task].kind
        self.train = PromptTrainData(rows.train, encoder, seed)
        self.eval_examples: list[Example] = rows.eval
        self.encoder, self.eval_batch_size, self.max_new_tokens = encoder, eval_batch_size, max_new_tokens
        lengths = [len(encoder.encode(e.prompt, c)[0]) for e in rows.train + rows.eval for c in e.continuations]
        extra = max_new_tokens if self.kind == "generation" else 0
        self.longest = min(max(lengths) + extra, encoder.max_length)

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        return self.train.batch(batch_size, step)

    def evaluate(self, engine, parallel) -> dict[str, float]:
        from distzo.evaluation import evaluate_choices, evaluate_generation

        if self.kind == "generation":
            return evaluate_generation(
                engine, self.eval_examples, self.encoder, parallel, self.eval_batch_size, self.max_new_tokens
            )
        return evaluate_choices(engine, self.eval_examples, self.encoder, parallel, self.eval_batch_size)
