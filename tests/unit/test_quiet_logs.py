"""What the log says, and says once: figures in the unit that fits (never ``0.000 B
parameters``), each hub retry warning once and only on a node's first rank,
transformers' bars off while distzo saves and back afterwards, the progress line's
rate and ETA, and an engine line that names only what its layout has."""

import io
import logging

import pytest
import torch
from transformers.utils import logging as hf_logging

from distzo import ZOConfig, ZOEngine
from distzo.engine.parts import describe
from distzo.job.progress import Progress, no_library_bars
from distzo.models.hub import HUB_HTTP_LOGGER, OnceOnFirstLocalRank, quiet_hub_retries
from distzo.runtime.units import format_bytes, format_count
from tests.helpers.models import tiny_opt


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (999, "999 B"),
        (1023, "1.02 KB"),
        (1024, "1.02 KB"),
        (999_999, "1.00 MB"),  # rounds up into the next unit, not "1000.00 KB"
        (1.5e9, "1.50 GB"),
        (695.85e9, "695.85 GB"),
        (2.5e12, "2.50 TB"),
    ],
)
def test_bytes_take_the_decimal_unit_that_fits(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    "n, text",
    [(0, "0"), (999, "999"), (21_310, "21.31 K"), (1.2e6, "1.20 M"), (7e9, "7.00 B")],
)
def test_parameter_counts_take_the_unit_that_fits(n, text):
    assert format_count(n) == text


@pytest.fixture
def hub_logger(caplog):
    """The hub's HTTP logger without the filter an earlier trainer of this process installed,
    its records caught here whatever earlier tests did to its ancestors (a library's
    verbosity raised to ERROR, its propagation off)."""
    logger = logging.getLogger(HUB_HTTP_LOGGER)
    kept = list(logger.filters), logger.level, logger.propagate
    # a trainer built earlier in this process installed its own filter (with what it saw)
    logger.filters[:] = [f for f in kept[0] if not isinstance(f, OnceOnFirstLocalRank)]
    logger.setLevel(logging.WARNING)
    logger.propagate = False  # caught once, by caplog's handler here
    logger.addHandler(caplog.handler)
    yield logger
    logger.removeHandler(caplog.handler)
    logger.filters[:], level, logger.propagate = kept
    logger.setLevel(level)


def test_a_hub_retry_warning_is_said_once_and_only_on_the_first_local_rank(hub_logger, caplog):
    once = quiet_hub_retries(local_rank=0)
    assert quiet_hub_retries(local_rank=0) is once  # installed once per process
    for _ in range(3):
        hub_logger.warning("Retrying in 1s [Retry 1/5].")
    hub_logger.warning("Retrying in 2s [Retry 2/5].")
    said = [r.getMessage() for r in caplog.records if r.name == HUB_HTTP_LOGGER]
    assert said == ["Retrying in 1s [Retry 1/5].", "Retrying in 2s [Retry 2/5]."]

    caplog.clear()
    quiet_hub_retries(local_rank=1)
    hub_logger.warning("Retrying in 4s [Retry 3/5].")
    assert not [r for r in caplog.records if r.name == HUB_HTTP_LOGGER]
    assert sum(isinstance(f, OnceOnFirstLocalRank) for f in hub_logger.filters) == 1


def test_library_bars_are_off_inside_and_as_the_user_had_them_after():
    assert hf_logging.is_progress_bar_enabled()
    with no_library_bars():
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a user who turned them off keeps them off
    try:
        with no_library_bars():
            pass
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def test_the_progress_line_gives_the_sessions_rate_and_the_time_left(monkeypatch):
    clock = iter([100.0, 110.0])
    monkeypatch.setattr("distzo.job.progress.time.perf_counter", lambda: next(clock))
    progress = Progress(start=200, total=1000, show=True)  # a resumed run, at step 200
    assert progress.bar is None  # pytest's stderr is no terminal
    # 50 steps in 10 s: 5 steps/s, 750 steps left: 150 s.
    assert progress.describe(250) == "5.00 steps/s, ETA 02:30"
    progress.close()


@pytest.mark.parametrize(
    ("steps", "seconds", "written"),
    [
        (2469, 2.0, "1234.50 steps/s, ETA 00:00"),  # a tiny run: %.3g wrote 1.23e+03
        (1, 80.0, "80.00 s/step, ETA 3:18:40"),  # a large model: not 0.0125 steps/s
    ],
)
def test_the_step_lines_rate_is_written_as_tqdm_writes_it(monkeypatch, steps, seconds, written):
    clock = iter([0.0, seconds])
    monkeypatch.setattr("distzo.job.progress.time.perf_counter", lambda: next(clock))
    progress = Progress(start=0, total=max(steps, 150), show=False)
    assert progress.describe(steps) == written


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_is_drawn_only_on_a_terminal_and_only_where_asked(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert Progress(start=0, total=10, show=False).bar is None  # another rank than 0
    progress = Progress(start=0, total=10, show=True)
    progress.update(5, loss="1.2345")
    progress.close()
    assert "train:  50%" in terminal.getvalue() and "5/10" in terminal.getvalue()
    assert "loss=1.2345" in terminal.getvalue()


def test_the_bar_counts_steps_per_second_as_the_step_line_does(monkeypatch):
    # the bar said "60.75it/s" under a step line's "60.2 steps/s"
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    progress = Progress(start=0, total=10, show=True)
    progress.update(5)
    progress.close()
    assert " steps/s" in terminal.getvalue() and "it/s" not in terminal.getvalue()


def test_the_hubs_bars_stay_off_after_a_save_where_the_user_turned_them_off():
    from huggingface_hub import utils as hub_utils

    hub_utils.disable_progress_bars()  # the hub's off, transformers' on
    try:
        with no_library_bars():
            pass
        assert hub_utils.are_progress_bars_disabled() and hf_logging.is_progress_bar_enabled()
    finally:
        hub_utils.enable_progress_bars()


class Result:
    loss, projected_grad, lr = 1.25, 0.5, 1e-3


def test_the_step_line_is_logged_every_log_every_steps_and_at_the_last(caplog):
    """Counted in steps done, as the evaluation and done lines are: the last line said
    step 7/8 just before 'done: 8 steps'."""
    caplog.set_level(logging.INFO, logger="distzo.train")
    progress = Progress(start=0, total=8, show=False)
    for step in range(8):
        progress.log_step(step, Result(), every=3)
    logged = [r.getMessage().split(" loss")[0] for r in caplog.records]
    assert logged == ["step 1/8", "step 3/8", "step 6/8", "step 8/8"]
    progress.close()


def test_the_engine_line_of_a_resident_model_names_no_transfer_slots_or_host_copy():
    """Resident blocks never travel: the line said ``none transfer, fp32 on the wire``,
    ``2 slots`` and ``0 B host``; the offloaded engine's line still names all three."""
    config = dict(lr=1e-2, eps=1e-3, device="cpu", seed=0)
    resident = ZOEngine(tiny_opt(seed=0), ZOConfig(mode="resident", **config))
    said = describe(resident, torch.float32)
    assert said.startswith("ZO engine: resident mode (float32 compute) on cpu, 2 blocks, ")
    for absent in ("transfer", "on the wire", "slots", "host"):
        assert absent not in said, absent
    offload = describe(ZOEngine(tiny_opt(seed=0), ZOConfig(**config)), torch.float32)
    assert "(naive transfer, fp32 on the wire, float32 compute)" in offload
    assert "2 blocks, 3 slots, " in offload and " host, spsa" in offload
