import copy
import dataclasses
import re
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from distzo.config.checks import check_job, default_lr, resolve_defaults
from distzo.config.engine_options import ZOConfig, engine_default
from distzo.config.job import (
    ENGINE_ONLY,
    JOB_RESOLVED,
    JobConfig,
    build_parser,
    engine_owners,
    resolve,
    to_toml,
    write_resolved,
)
from distzo.dist import LaunchEnv
from distzo.job.validation import validate
from tests.helpers.launch import train_in_process

CONFIG_0_1 = Path(__file__).parents[1] / "helpers" / "data" / "config-0.1.toml"


def test_defaults_then_file_then_flags(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[optim]\nlr = 0.5\nmax_steps = 7\n[offload]\nmode = "resident"\n')
    job = resolve(["--config", str(path), "--max-steps", "9", "--eps", "0.01"])
    assert job.optim.lr == 0.5  # from the file
    assert job.optim.max_steps == 9  # the flag beats the file
    assert job.optim.eps == 0.01  # a flag alone
    assert job.offload.mode == "resident"
    assert job.data.batch_size == JobConfig().data.batch_size  # untouched default


@pytest.mark.parametrize(
    "text, warned",
    [
        ('resume = "yes"\noverwrite = true\n', "resume = 'yes' and overwrite = True"),
        ("resume = true\n", "resume = True"),  # the boolean files wrote before modes
        ('resume = "no"\noverwrite = false\n', None),  # what 0.1's config.toml records
    ],
)
def test_a_file_never_resumes_or_overwrites_a_run_directory(tmp_path, caplog, text, warned):
    # --resume and --overwrite act on the directory of one command: an older config.toml that
    # records them loads, and passed back for a new run does not resume or delete anything.
    path = tmp_path / "config.toml"
    path.write_text("[optim]\nlr = 0.5\n[run]\n" + text)
    with caplog.at_level("WARNING", logger="distzo.train"):
        job = resolve(["--config", str(path)])
    assert (job.optim.lr, job.run.resume, job.run.overwrite) == (0.5, None, False)
    expected = (
        [
            f"--config {path}: [run] {warned} ignored: --resume and --overwrite act on the run "
            "directory and are given on the command line, never by a file"
        ]
        if warned
        else []
    )
    assert [r.getMessage() for r in caplog.records] == expected
    assert resolve(["--config", str(path), "--resume"]).run.resume == "yes"  # the flag acts


@pytest.mark.parametrize(
    "text, message",
    [
        ("[optim]\nlearning_rate = 1\n", "unknown key 'learning_rate' in \\[optim\\]"),
        ("[optimiser]\nlr = 1\n", "unknown section \\[optimiser\\]; did you mean \\[optim\\]\\?"),
        ("[zzz]\nlr = 1\n", "unknown section \\[zzz\\]; sections are model, data, optim"),
        # a key of another section: its home, not a neighbour's name (save_steps)
        ("[run]\nmax_steps = 3\n", "'max_steps' in \\[run\\]; it is an option of \\[optim\\]"),
        ("[optim]\nmax_steps = 'ten'\n", "max_steps must be an integer, got 'ten'"),
        ("[optim]\nlr = '1e-3'\n", "lr must be a number, got '1e-3'"),
        (
            "max_steps = 3\n[optim]\nlr = 1\n",
            "max_steps is outside any section; write it under \\[optim\\]",
        ),
        ("steps = 3\n", "'steps' is outside any section, and no section has such a key"),
        ("[optim\nlr = 1\n", "not valid TOML"),
        ('[model]\ndtype = "fp16"\n', "\\[model\\] dtype must be one of fp32, fp64, got 'fp16'"),
        ('[run]\nreport_to = "mlflow"\n', "report_to must be one of none, tensorboard, wandb"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        resolve(["--config", str(path)])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "section, key", [("run", "output_dir"), ("run", "log_dir"), ("model", "model")]
)
def test_an_empty_path_in_a_file_is_refused_as_the_flags_is(tmp_path, monkeypatch, section, key):
    """``output_dir = ""`` trained into a new ./runs/<timestamp> where ``--output-dir ""``
    is refused; ``log_dir = ""`` logged into the run directory; ``model = ""`` was a hub
    error about repository names."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.toml").write_text(f'[{section}]\n{key} = ""\n')
    proc = train_in_process(["--config", "job.toml", "--max-steps", "1"])
    assert proc.returncode == 2
    assert proc.stderr == (
        f"error: --config job.toml: [{section}] {key} is empty; give a path or remove the key\n"
    )
    assert not (tmp_path / "runs").exists()


def test_a_config_that_is_a_folder_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=f"--config {tmp_path}: cannot read it") as info:
        resolve(["--config", str(tmp_path)])
    assert "\n" not in str(info.value)


def test_resolved_config_round_trips(tmp_path):
    job = resolve(["--lr", "0.25", "--dp", "2", "--output-dir", "somewhere"])
    path = write_resolved(job, tmp_path)
    again = resolve(["--config", str(path)])
    assert again == job
    assert tomllib.loads(to_toml(job))["optim"]["lr"] == 0.25


def test_help_documents_every_option_with_its_default():
    text = build_parser().format_help()
    for section, values in JobConfig().sections().items():
        assert f"[{section}]" in text
        for name in vars(values):
            assert "--" + name.replace("_", "-") in text
    flat = " ".join(text.split())
    assert "(default: 2000)" in flat and "(default: 1e-6, MeZO's, for --model" in flat
    assert "(default: None)" not in flat  # a None default is explained by the option's own text


def test_eval_batch_size_help_says_it_sizes_a_call_not_the_evaluation_set():
    """It read "sequences in the evaluation set": true of counting only; a file task
    evaluates every row of its --eval-file (or the --num-eval drawn), this many per call."""
    flat = " ".join(build_parser().format_help().split())
    assert (
        "sequences per evaluation forward call over all ranks; the whole --eval-file (its "
        "--num-eval rows with that flag) is evaluated" in flat
    )


def test_save_on_signal_help_names_ctrl_c_as_the_docs_table_does():
    """The handler stops on SIGINT too (exit 130) and --save-on-signal saves then: the
    help named SIGTERM and SIGUSR1 alone."""
    flat = " ".join(build_parser().format_help().split())
    assert "or Ctrl-C (SIGINT) write a checkpoint after the step under way" in flat


EXAMPLES = sorted(Path(__file__).parents[2].joinpath("launch", "configs").glob("*.toml"))
KEY_LINE = re.compile(r"^(\w+) = [^#]*?(#.*)?$")


def default_of(job: JobConfig, section: str, key: str) -> object:
    """What ``key`` would be in ``job`` had the file not set it: the tree's default, resolved
    against the file's other options (the lr on its model), or the engine's for None."""
    probe = copy.deepcopy(job)
    setattr(getattr(probe, section), key, getattr(getattr(JobConfig(), section), key))
    resolve_defaults(probe)
    value = getattr(getattr(probe, section), key)
    return engine_default(key) if value is None and key in engine_owners() else value


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_configs_resolve_and_say_which_lines_are_defaults(path):
    # default.toml spells the default run out: a line that departs from it says so. The
    # others are recipes: a line that sets an option to its default says so (or goes).
    assert len(EXAMPLES) == 3
    job = resolve(["--config", str(path)])
    resolve_defaults(job)
    job.validate()
    spells_defaults = path.name == "default.toml"
    unexplained, section = [], ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("["):
            section = line.strip("[]")
            continue
        match = KEY_LINE.match(line)
        if match is None:
            assert not line or line.startswith("#"), f"{path.name}:{number}: {line}"
            continue
        key, comment = match.groups()
        is_default = getattr(getattr(job, section), key) == default_of(job, section, key)
        if is_default != spells_defaults and not comment:
            unexplained.append(f"{path.name}:{number}: {line}")
    assert not unexplained, unexplained


def test_cli_reports_an_unknown_key_in_one_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optim]\nlr_max = 1\n")
    proc = train_in_process(["--config", str(path)])
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().startswith("error: --config")
        and len(proc.stderr.strip().splitlines()) == 1
    )


def test_every_engine_option_is_declared_by_one_section_or_resolved_by_the_job():
    declared: dict[str, list[str]] = {}
    for section, values in JobConfig().sections().items():
        for f in dataclasses.fields(values):
            if "engine" in f.metadata:
                assert f.metadata["engine"] == f.name  # the ZOConfig field of the same name
                declared.setdefault(f.name, []).append(section)
    engine = {f.name for f in dataclasses.fields(ZOConfig)}
    assert set(declared) <= engine
    for name in engine:
        if name in JOB_RESOLVED + ENGINE_ONLY:
            assert name not in declared, name
        else:
            assert len(declared.get(name, [])) == 1, (name, declared.get(name))


# The engine options whose job default is the job's own, each explained in its help.
JOB_DEFAULTS = {"max_steps": 2000, "lr_schedule": "linear"}


def test_an_engine_option_defaults_to_the_engine_or_to_none_that_the_job_resolves():
    for section, f in ((s, f) for s, v in JobConfig().sections().items() for f in fields(v)):
        if "engine" not in f.metadata:
            continue
        if f.name in JOB_DEFAULTS:
            assert f.default == JOB_DEFAULTS[f.name]
        else:
            assert f.default in (None, engine_default(f.name)), (section, f.name)
            assert f.default is not None or "default" in f.metadata["help"], f.name


def test_the_engine_config_is_taken_from_the_sections():
    job = resolve(
        "--eps 0.01 --lr 0.5 --num-slots 2 --mode offload --peft lora --dual-forward "
        "--optimizer momentum --noise rademacher --seed -1 --grad-accum 2 --num-queries 3 "
        "--low-bit-master buffer --perturb-scope block".split()
    )
    config = job.engine_config("cpu")
    for name, section in engine_owners().items():
        assert getattr(config, name) == getattr(getattr(job, section), name), name
    assert (config.device, config.seed, config.noise_chunk) == (
        "cpu",
        None,  # -1: rank 0 draws one
        engine_default("noise_chunk"),
    )
    unset = JobConfig().engine_config("cpu")  # None options keep the engine's defaults
    assert (unset.num_slots, unset.noise, unset.num_queries) == (
        engine_default("num_slots"),
        "gaussian",
        1,
    )


def test_fzoo_takes_its_own_noise_and_queries_unless_told_otherwise():
    fzoo = resolve(["--estimator", "fzoo"])
    config = fzoo.engine_config("cpu")
    assert (config.estimator, config.noise, config.num_queries) == ("fzoo", "rademacher", 8)
    resolve_defaults(fzoo)  # config.toml records the resolved N
    assert fzoo.optim.num_queries == 8 and fzoo.optim.noise is None  # noise: at validation
    told = resolve("--estimator fzoo --noise gaussian --num-queries 4".split())
    config = told.engine_config("cpu")
    assert (config.noise, config.num_queries) == ("gaussian", 4)
    spsa = resolve([])
    resolve_defaults(spsa)
    assert spsa.optim.num_queries == 1 and spsa.engine_config("cpu").noise == "gaussian"
    # a pretrained model's lr: FZOO's script's 1e-5, MeZO's 1e-6 for SPSA and for LOZO
    # (its README's 1e-6 or 1e-7; docs/training.md says 1e-6 but for FZOO)
    shape = ["--model-config", "opt-13b"]
    assert default_lr(resolve([*shape, "--estimator", "fzoo"])) == 1e-5
    assert default_lr(resolve(shape)) == 1e-6
    assert default_lr(resolve([*shape, "--estimator", "lozo"])) == 1e-6


@pytest.mark.parametrize(
    "section, values, message",
    [
        ("model", {"model": "a", "model_config": "opt-13b"}, "both name a model"),
        ("model", {"model_layers": 2}, "--model-layers only applies to --model-config"),
        ("data", {"batch_size": 0}, "--batch-size must be >= 1, got 0"),
        ("data", {"eval_batch_size": 0}, "--eval-batch-size must be >= 1, got 0"),
        ("data", {"max_new_tokens": 0}, "--max-new-tokens must be >= 1"),
        ("optim", {"max_steps": -1}, "--max-steps must be >= 0"),
        ("peft", {"lora_r": 0}, "--lora-r must be >= 1"),
        ("peft", {"batch_queries": True}, "need an adapter"),
        (
            "parallel",
            {"threads": -1},
            "--threads must be >= 0 \\(0: cores / local ranks\\), got -1",
        ),
        ("run", {"save_steps": -1}, "^--save-steps must be >= 0 \\(0: off\\), got -1$"),
        ("run", {"eval_steps": -2}, "^--eval-steps must be >= 0 \\(0: off\\), got -2$"),
        ("run", {"log_sync_steps": 0}, "--log-sync-steps must be >= 1"),
    ],
)
def test_each_section_validates_its_own_options(section, values, message):
    job = JobConfig()
    for key, value in values.items():
        setattr(getattr(job, section), key, value)
    with pytest.raises(ValueError, match=message):
        getattr(job, section).validate()
    JobConfig().validate()  # the defaults pass


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (["--dp", "3"], 3, "--batch-size 16 is not divisible by --dp 3"),
        (["--transfer", "sliced"], 1, "--transfer sliced needs a torchrun launch"),
        (["--task", "sst2", "--objective", "f1"], 1, "--objective"),
        (["--grad-accum", "9"], 2, "--grad-accum 9 must be between 1 and the 8 sequences"),
        (["--eval-batch-size", "2"], 4, "--eval-batch-size 2 is smaller than the 4 ranks"),
    ],
)
def test_checks_across_sections_and_against_the_launch(argv, world, message):
    job = resolve(argv + ["--pert", "1"])
    resolve_defaults(job)
    with pytest.raises(ValueError, match=message):
        check_job(job, LaunchEnv(world_size=world, launched=world > 1))


def test_defaults_that_depend_on_another_section_are_resolved_into_the_tree():
    job = resolve(["--task", "copa"])
    resolve_defaults(job)
    assert (job.optim.lr, job.optim.objective) == (default_lr(job), "lm")


def test_a_config_written_by_version_0_1_resolves_to_the_default_options():
    # config.toml of a default run before the engine's options joined the tree (issue 27).
    old, default = resolve(["--config", str(CONFIG_0_1)]), resolve([])
    assert old.run.output_dir == "/tmp/base/run"  # where that run wrote: another run's now
    old.run.output_dir = None
    checked_old, checked_default = validate(old, LaunchEnv()), validate(default, LaunchEnv())
    assert checked_old.config == checked_default.config  # the engine's options
    # The file records the slot count that run's memory plan chose: the engine's default.
    assert old.offload.num_slots == engine_default("num_slots")
    old.offload.num_slots = None
    # It records threads = 0, then the default; 0 now asks for cores / local ranks, the
    # count a plain run then had (PyTorch's own default), where the default is now 1.
    assert old.parallel.threads == 0
    old.parallel.threads = None
    assert old == default


def test_the_export_shard_size_is_checked_before_any_model(tmp_path):
    # A value check the exporter owns: the job runs it with the other checks, before a model.
    proc = train_in_process(["--export-shard-size", "big", "--output-dir", str(tmp_path / "run")])
    assert proc.returncode == 2
    assert "--export-shard-size 'big' is not a size" in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "run").exists()


def test_a_leading_tilde_in_a_path_option_is_the_home_folder(tmp_path, monkeypatch):
    """A TOML file or ``--flag=~/x`` passes ``~`` on unexpanded: the run once went into a
    folder named ``~`` under the working directory, and a ``--model`` there was refused as
    a hub name."""
    from tests.helpers.models import tiny_opt

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    tiny_opt().save_pretrained(tmp_path / "model")
    (tmp_path / "job.toml").write_text('[run]\noutput_dir = "~/runs/a"\n')
    job = resolve(["--config=~/job.toml", "--model=~/model", "--log-dir=~/logs"])
    validate(job, LaunchEnv())  # loads the model's config from the folder
    assert job.run.output_dir == str(tmp_path / "runs" / "a")
    assert (job.model.model, job.run.log_dir) == (str(tmp_path / "model"), str(tmp_path / "logs"))
    assert not (tmp_path / "~").exists()


def test_help_says_what_each_string_option_takes():
    """Every string option showed ``STR`` (``--output-dir STR``, ``--config CONFIG``)."""
    from distzo.config.job import build_parser

    text = build_parser().format_help()
    assert " STR" not in text and "CONFIG" not in text
    for shown in ("--config FILE", "--train-file FILE", "--output-dir DIR", "--model NAME_OR_DIR"):
        assert shown in text, shown


def test_a_tilde_naming_no_user_stays_as_written_as_in_a_shell():
    """``~name`` of a user the machine does not know: a shell leaves it as it is, where
    ``Path.expanduser`` raises a RuntimeError (a traceback, not the one-line refusal)."""
    from distzo.config.cli import home_path
    from distzo.models.hub import base_reference, local_model_dir

    name = "~no-such-user-of-distzo/model"
    assert home_path(name) == Path(name)
    assert base_reference(name) == name
    with pytest.raises(ValueError, match=f"--model {name}: no such directory"):
        local_model_dir(name)


def test_momentums_beta1_is_kept_without_a_warning(caplog):
    with caplog.at_level("WARNING", logger="distzo.train"):
        job = resolve(["--optimizer", "momentum", "--beta1", "0.8"])
    assert job.optim.beta1 == 0.8
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
