"""A stand-in for the ``wandb`` package (tests only: put ``tests/helpers/fake_wandb`` first on
PYTHONPATH): records every call of the API distzo uses (``init``, ``Run.log``,
``Run.finish``) as JSON lines in ``$FAKE_WANDB_LOG``, so a test can check what a run
reported without wandb installed or a network. With ``$FAKE_WANDB_NO_KEY`` set, ``init``
fails as wandb 0.31's does when no API key is configured."""

import json
import os

from . import errors


def _record(call: str, **fields) -> None:
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"call": call, **fields}, default=str) + "\n")


class Run:
    def log(self, data: dict, step: int | None = None) -> None:
        _record("log", data=data, step=step)

    def finish(self) -> None:
        _record("finish")


def init(**kwargs) -> Run:
    if os.environ.get("FAKE_WANDB_NO_KEY"):
        raise errors.UsageError("No API key configured. Use `wandb login` to log in.")
    _record(
        "init",
        **{k: v for k, v in kwargs.items() if k != "config"},
        has_config=bool(kwargs.get("config")),
    )
    return Run()
