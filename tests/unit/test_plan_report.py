"""The memory plan's figures in docs/models.md are what ``python -m distzo.job.plan_report``
prints (issue 29: Llama-70B on 8 GPUs, dp 4 x pert 2, sliced, term by term)."""

import re
import shlex
from pathlib import Path

import pytest

from distzo.job import plan_report

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def documented_reports():
    """(arguments, printed block) of every plan_report command docs/models.md shows."""
    pattern = r"\$ python -m distzo\.job\.plan_report ([^\n]*)\n(.*?)\n```"
    return [
        (shlex.split(args), block) for args, block in re.findall(pattern, DOC.read_text(), re.S)
    ]


def test_the_documented_plans_are_what_the_command_prints(monkeypatch, capsys):
    """Llama-2-70B's, and MeZO's RoBERTa-large run on one GPU (the tied decoder counted
    once: 355.41 M parameters, a resident bucket of the embeddings and the head's dense)."""
    for name in ("NCCL_BUFFSIZE", "NCCL_MAX_NCHANNELS", "NCCL_NVLS_ENABLE", "NCCL_NVLS_NCHANNELS"):
        monkeypatch.delenv(name, raising=False)  # the doc's figures are NCCL's defaults
    reports = documented_reports()
    roberta = "--model-config roberta-large --nproc 1 --transfer naive --transfer-dtype fp32"
    roberta += " --compute-dtype fp32 --batch-size 32 --seq-len 128"
    assert [args for args, _ in reports] == [
        roberta.split(),
        ["--model-config", "llama-2-70b", "--dp", "4", "--pert", "2"],
    ]
    printed = []
    for args, block in reports:
        assert plan_report.main(args) == 0
        printed.append(capsys.readouterr().out.strip())
        assert printed[-1] == block.strip()
    assert "NCCL buffers" in block and "device total" in block and "host total" in block
    assert "355.41 M parameters" in printed[0] and "resident 424.82 MB" in printed[0]
    assert "the export +1.63 GB host on rank 0" in printed[0]


def test_a_layout_that_is_not_the_node_is_refused_in_one_line(capsys):
    assert plan_report.main(["--model-config", "opt-125m", "--dp", "3", "--pert", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --dp 3 x --pert 2 = 6 does not match the 8 launched ranks")
    assert plan_report.main(["--model-config", "opt-125m", "--pert", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "error: --pert 4 is more ranks than the 2 forward passes of a step (--estimator spsa, "
        "--num-queries 1)"
    )


def test_the_report_accepts_what_training_accepts_and_refuses_what_it_refuses(capsys):
    argv = ["--model-config", "opt-125m", "--nproc", "8"]
    assert plan_report.main([*argv, "--dp", "4"]) == 0  # pert = 8 / 4, as distzo.train takes it
    assert "dp 4 x pert 2" in capsys.readouterr().out
    assert plan_report.main([*argv, "--nproc", "2", "--batch-size", "7"]) == 2
    assert "--batch-size 7 is not divisible by --dp 2" in capsys.readouterr().err
    assert plan_report.main([*argv, "--eval-batch-size", "4"]) == 2
    assert "--eval-batch-size 4 is smaller than the 8 ranks" in capsys.readouterr().err


def test_the_report_plans_fzoos_hidden_states():
    def report(*flags):
        argv = ["--model-config", "opt-125m", "--pert", "2", *flags]
        return plan_report.report(plan_report._parser().parse_args(argv))

    spsa, fzoo = report(), report("--estimator", "fzoo")
    assert "passes per step" not in spsa
    assert "fzoo with 9 passes per step, 8 rows x 512 tokens" in fzoo
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9}
    activations = [
        float(line.split()[-2]) * units[line.split()[-1]]
        for text in (spsa, fzoo)
        for line in text.splitlines()
        if line.strip().startswith("activations")
    ]
    assert activations[1] > activations[0]  # 5 hidden states on pert rank 0, not 1
    wide = report("--estimator", "fzoo", "--pert", "8", "--dp", "1")  # a pass or two per rank
    assert "dp 1 x pert 8" in wide


@pytest.mark.parametrize("pert", [1, 2])
def test_the_report_plans_the_rows_a_rank_forwards(pert):
    args = plan_report._parser().parse_args(
        ["--model-config", "opt-125m", "--pert", str(pert), "--eval-batch-size", "8"]
    )
    # a step's 16 // dp rows against an evaluation call's ceil(8 / 8) = 1
    assert f"{16 // (8 // pert)} rows x 512 tokens" in plan_report.report(args)


def test_the_documented_opt_175b_plans_are_what_the_command_prints():
    """docs/distributed.md and the README quote OPT-175B on one GPU at 1 x 2048 in fp16,
    masters rebuilt, by perturb scope and slots: those are the command's device totals."""
    base = "--model-config opt-175b --nproc 1 --transfer naive --transfer-dtype fp16"
    base += " --compute-dtype fp16 --batch-size 1 --eval-batch-size 1 --seq-len 2048"
    base += " --low-bit-master recompute"

    def total(*flags):
        text = plan_report.report(plan_report._parser().parse_args([*base.split(), *flags]))
        (line,) = [line for line in text.splitlines() if "device total" in line]
        return " ".join(line.split()[-2:])

    plans = {
        (scope, slots): total("--perturb-scope", scope, "--num-slots", slots)
        for scope in ("block", "module")
        for slots in ("3", "2")
    }
    assert plans == {
        ("block", "3"): "19.12 GB",
        ("block", "2"): "15.50 GB",
        ("module", "3"): "15.42 GB",
        ("module", "2"): "11.80 GB",
    }
    guide = (DOC.parent / "distributed.md").read_text()
    assert "plans 19.12 GB of device memory" in guide and "`--num-slots 2` 15.50 GB" in guide
    assert "15.42 GB with 3 slots and 11.80 GB with 2" in guide
    readme = (DOC.parents[1] / "README.md").read_text()
    assert "15.4 GB of GPU memory for OPT-175B" in readme and "(11.8 GB with\ntwo" in readme


def test_a_50_candidate_example_plans_the_rows_a_training_forward_takes():
    """docs/optimizers.md quotes OPT-13B on one GPU at 2048 tokens in fp16, one ReCoRD-like
    example of 50 candidate rows a step: whole, and at most 4 rows a forward."""
    base = "--model-config opt-13b --nproc 1 --transfer naive --transfer-dtype fp16"
    base += " --compute-dtype fp16 --batch-size 1 --eval-batch-size 4 --seq-len 2048"
    base += " --rows-per-example 50"

    def plan(*flags):
        text = plan_report.report(plan_report._parser().parse_args([*base.split(), *flags]))
        figures = {
            line.split()[0]: " ".join(line.split()[-2:])
            for line in text.splitlines()
            if line.strip().startswith(("activations", "device total"))
        }
        return text.splitlines()[0], figures["activations"], figures["device"]

    head, *whole = plan()
    assert head.endswith("50 rows x 2048 tokens per forward") and whole == ["15.10 GB", "20.73 GB"]
    head, *bounded = plan("--micro-batch-rows", "4")
    assert head.endswith("(a step's at most 4 at a time)") and bounded == ["3.14 GB", "8.76 GB"]
    head, *at_the_rows = plan("--micro-batch-rows", "50")  # a bound the step fits: no split
    assert head.endswith("50 rows x 2048 tokens per forward") and at_the_rows == whole
    guide = (DOC.parent / "optimizers.md").read_text()
    assert "20.73 GB of device memory" in guide and "`--micro-batch-rows 4` 8.76 GB" in guide


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--seq-len", "-5"], "error: --seq-len must be >= 1, got -5"),
        (["--rows-per-example", "0"], "error: --rows-per-example must be >= 1, got 0"),
        (
            ["--micro-batch-rows", "-1"],
            "error: --micro-batch-rows must be >= 0, got -1; 0 leaves a micro-batch's rows "
            "unbounded",
        ),
        (
            ["--seq-len", "4096"],
            "error: --seq-len 4096 exceeds opt-125m's max_position_embeddings 2048; lower "
            "--seq-len",
        ),
        (
            ["--model-config", "roberta-large", "--seq-len", "513"],
            "error: --seq-len 513 exceeds roberta-large's max_position_embeddings 514 (512 "
            "token positions); lower --seq-len",
        ),
        (["--batch-size", "0"], "error: --batch-size must be >= 1, got 0"),
        (["--nproc", "0"], "error: --nproc must be >= 1, got 0"),
        (["--eval-batch-size", "0"], "error: --eval-batch-size must be >= 1, got 0"),
        (
            ["--num-queries", "0"],
            "error: --num-queries must be >= 1, got 0; use 1 for MeZO's SPSA, more to average "
            "directions",
        ),
        (
            ["--num-slots", "0"],
            "error: --num-slots must be >= 1, got 0; use 2 or 3 to overlap transfers, 1 for "
            "least memory",
        ),
        (
            ["--estimator", "fzoo", "--num-queries", "1"],
            "error: --estimator fzoo needs --num-queries >= 2, got 1: sigma, the spread of its "
            "perturbed losses, is 0 for one; its default is 8",
        ),
    ],
)
def test_sizes_training_refuses_are_one_line_naming_the_flag(flags, line, capsys):
    """A plan of a batch of 0 or -5 tokens printed negative activations; the engine's checks
    named num_slots where the user typed --num-slots."""
    assert plan_report.main(["--model-config", "opt-125m", *flags]) == 2
    assert capsys.readouterr().err == line + "\n"


def test_model_layers_plans_the_shape_cut_as_distzo_train_cuts_it(capsys):
    """--model-layers, as distzo.train takes it: the plan of the shape's first N layers,
    named in the report's first line; a count below 1 is distzo.train's one line."""
    argv = ["--model-config", "opt-13b", "--nproc", "1", "--seq-len", "2048", "--batch-size", "1"]
    assert plan_report.main(argv) == 0
    whole = capsys.readouterr().out
    assert plan_report.main([*argv, "--model-layers", "2"]) == 0
    cut = capsys.readouterr().out
    assert whole.startswith("opt-13b, 1 GPU on one node") and "12.85 B parameters" in whole
    assert cut.startswith("opt-13b (2 layers), 1 GPU on one node")
    assert "897.18 M parameters" in cut  # the embeddings, the head and 2 of 40 blocks
    assert plan_report.main([*argv, "--model-layers", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --model-layers must be >= 1, got 0"
