"""The documentation is checked: README.md and docs/*.md run their CPU blocks, name only
flags that exist, and link only to files and headings that exist."""

import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from distzo.config.job import JobConfig, build_parser, resolve
from tests.helpers.launch import child_env, free_port

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = "<!-- runnable on CPU -->"
RUNNABLE_TORCHRUN = "<!-- runnable on CPU under torchrun -->"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\s*$")
LAUNCH_FILES = sorted(p for p in (ROOT / "launch").rglob("*") if p.is_file())
CONFIGS = sorted((ROOT / "launch" / "configs").glob("*.toml"))


def runnable_blocks(path: Path, marker: str = RUNNABLE) -> list[tuple[str, str]]:
    """(language, code) of every fenced block right after the runnable marker."""
    lines = path.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() == marker:
            fence = FENCE.match(lines[i + 1])
            assert fence is not None, f"{path}:{i + 2}: the runnable marker is not above a fence"
            language = fence.group(1)
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            blocks.append((language, "\n".join(lines[i + 2 : end])))
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    # headings, not code comments
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


RUNNABLE_PAGES = [page for page in PAGES if runnable_blocks(page)]


def test_the_pages_have_runnable_blocks():
    blocks = [block for page in PAGES for block in runnable_blocks(page)]
    assert len(blocks) >= 2 and {language for language, _ in blocks} >= {"bash", "python"}


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=[p.name for p in RUNNABLE_PAGES])
def test_every_runnable_block_runs_on_cpu(tmp_path, page):
    # A page's blocks run in order in one fresh directory: a later one may use what an
    # earlier one wrote (a run directory it resumes or replays).
    for language, code in runnable_blocks(page):
        command = (
            ["bash", "-euo", "pipefail", "-c", code]
            if language == "bash"
            else [sys.executable, "-c", code]
        )
        run_block(command, tmp_path, f"{page.name}:\n{code}")


def run_block(command: list[str], cwd: Path, what: str) -> None:
    """A documented block's command, on the CPU, that must succeed (``what`` names it)."""
    proc = subprocess.run(
        command,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env({"CUDA_VISIBLE_DEVICES": ""}),
    )
    assert proc.returncode == 0, f"{what}\n{proc.stderr[-3000:]}"


def train_flags_named(path: Path) -> set[str]:
    """Flags given to distzo.train: on command lines after ``distzo.train``/``distzo-train``,
    and in option tables (rows whose second cell names a flag)."""
    named = set()
    for line in path.read_text().splitlines():
        for program in ("distzo.train", "distzo-train"):
            if program in line:
                named |= set(
                    re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line.split(program, 1)[1])
                )
        row = re.match(r"^\| *\| *`(--[a-z][a-z0-9-]*)", line)
        if row:
            named |= set(re.findall(r"`(--[a-z][a-z0-9-]*)", line.split("|")[2]))
    return named


def test_every_flag_the_docs_give_the_training_job_exists():
    known = {option for action in build_parser()._actions for option in action.option_strings}
    known |= {"--no-" + o[2:] for o in known}
    missing = {
        f"{page.name}: {flag}"
        for page in [*PAGES, *LAUNCH_FILES]
        for flag in train_flags_named(page)
        if flag not in known
    }
    assert not missing, sorted(missing)


def help_flags(main: Callable[[list[str]], int], argv: list[str]) -> set[str]:
    """The flags a command's ``--help`` lists, from its ``main`` in this process."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(argv)
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", out.getvalue()))


def test_every_flag_the_docs_give_the_other_commands_exists():
    """Flags given to replay, plan_report and the exported training step on one line of a
    page (a code block's or a sentence's) are flags of that command, as for distzo.train."""
    from distzo import replay
    from distzo.export import training_step
    from distzo.job import plan_report

    programs = {
        "distzo.replay": help_flags(replay.main, ["--help"]),
        "distzo-replay": help_flags(replay.main, ["--help"]),
        "distzo.job.plan_report": help_flags(plan_report.main, ["--help"]),
        "distzo.export.training_step": help_flags(training_step.main, ["--help"]),
    }
    assert all(len(flags) > 3 for flags in programs.values()), programs
    missing, named = [], 0
    for page in [*PAGES, *LAUNCH_FILES]:
        text = re.sub(r"\\\n\s*", " ", page.read_text())  # a command continued with \
        for line in text.splitlines():
            for program, known in programs.items():
                if program in line:
                    given = line.split(program, 1)[1].split("`", 1)[0]
                    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", given))
                    named += len(flags)
                    missing += [f"{page.name}: {program} {f}" for f in flags - known]
    assert named >= 10 and not missing, sorted(missing)


# Values a page gives to show the one-line error the job answers them with.
QUOTED_AS_REFUSED = {"--mode foo"}
PLACEHOLDER = re.compile(r"[A-Z_]+|[a-z]|<[^>]*>|\.\.\.")


def test_every_value_the_docs_give_a_training_flag_is_one_it_takes():
    """A backticked ``--flag value`` (or ``--flag a|b|c``, each alternative) is one the
    job's parser takes: one of its choices, a number of its type. The flag tests above
    check the names only, so a value renamed or dropped in the code (a choice, a unit
    added to a number) would stay in the pages; a placeholder (``N``, ``q``) is let by,
    and so is a flag of another command the paragraph names (the exported step's
    ``--dtype bf16``)."""
    import contextlib
    import io

    from distzo import replay
    from distzo.export import training_step
    from distzo.job import plan_report

    others = {
        "distzo.replay": help_flags(replay.main, ["--help"]),
        "distzo-replay": help_flags(replay.main, ["--help"]),
        "plan_report": help_flags(plan_report.main, ["--help"]),
        "training_step": help_flags(training_step.main, ["--help"]),
    }
    parser = build_parser()
    valued = {o for a in parser._actions if a.nargs != 0 for o in a.option_strings}
    refused, checked = [], 0
    for page in PAGES:
        for paragraph in page.read_text().split("\n\n"):
            theirs = set().union(*(f for name, f in others.items() if name in paragraph))
            for flag, given in re.findall(r"`(--[a-z][a-z0-9-]*) \[?([^`\s\]]+)\]?`", paragraph):
                if flag not in valued or flag in theirs or PLACEHOLDER.fullmatch(given):
                    continue
                for value in given.replace("\\|", "|").split("|"):
                    if f"{flag} {value}" in QUOTED_AS_REFUSED:
                        continue
                    checked += 1
                    error = io.StringIO()
                    with contextlib.redirect_stderr(error), contextlib.suppress(SystemExit):
                        parser.parse_args([flag, value])
                    if error.getvalue():
                        refused.append(f"{page.name}: {error.getvalue().splitlines()[-1]}")
    assert checked >= 100 and not refused, refused


def test_every_relative_link_resolves():
    broken = []
    for page in [*PAGES, ROOT / "benchmarks" / "README.md"]:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_docs_page_is_reachable_from_the_readme():
    linked = {
        (ROOT / target.partition("#")[0]).resolve()
        for target in LINK.findall((ROOT / "README.md").read_text())
    }
    assert set((ROOT / "docs").glob("*.md")) <= linked


def test_help_points_each_section_to_a_docs_page_that_exists():
    from distzo.config.job import SECTION_DOCS, JobConfig

    assert set(SECTION_DOCS) == set(JobConfig().sections())
    pages = {page.strip() for value in SECTION_DOCS.values() for page in value.split(",")}
    assert all((ROOT / page).is_file() for page in pages), pages
    assert "[optim] docs/optimizers.md" in build_parser().format_help().replace("\n", " ")


# The default job's evaluation as the pages quote it: "4.1787 -> 1.7585" or "from 4.1787 to".
FIGURES = re.compile(r"(\d\.\d{4}) (?:->|to) (\d\.\d{4})")
QUOTING = ["README.md", "docs/training.md", "docs/distributed.md"]


def test_the_quoted_figures_of_the_default_job_start_where_a_real_run_starts(tmp_path):
    # The start, the random-init model's loss, is the same on every CPU: checked against a
    # run. The end depends on the CPU's float rounding, so only the pages' agreement on it
    # is checked: the README's end is the one training.md and the PertP run quote.
    from distzo.config.job import resolve
    from distzo.job.trainer import Trainer

    quoted = {name: FIGURES.findall((ROOT / name).read_text()) for name in QUOTING}
    assert all(quoted.values()), quoted
    flags = ["--max-steps", "1", "--device", "cpu", "--log-every", "0"]
    with Trainer(resolve([*flags, "--output-dir", str(tmp_path / "run")])) as trainer:
        trainer.train()
    assert trainer.eval_before is not None and trainer.eval_before["eval_accuracy"] == 0
    start = f"{trainer.eval_before['eval_loss']:.4f}"
    assert {before for pairs in quoted.values() for before, _ in pairs} == {start}
    end = quoted["README.md"][0][1]
    assert all(end in (ROOT / name).read_text() for name in QUOTING[1:]), end


@pytest.mark.parametrize("script", ["pinned", "noise"])
def test_the_benchmark_readme_names_each_fixed_derived_figure_a_script_writes(script):
    """The derived names a script writes under a fixed key are the ones its section of
    benchmarks/README.md gives (pinned.py's were renamed and the README kept the old)."""
    source = (ROOT / "benchmarks" / f"{script}.py").read_text()
    written = set(re.findall(r'derived\[\s*"([a-z_0-9]+)"\s*\]', source))
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    section = readme.split(f"## {script}.py", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z0-9]+(?:_[a-z0-9]+)+_over_[a-z_0-9]+)`", section))
    assert named <= written, f"{script}.py writes none of {sorted(named - written)}"


def test_the_torchrun_examples_run_on_two_cpu_ranks(tmp_path):
    """The Python API's torchrun example is a script the reader runs under torchrun; it
    called process-group helpers with arguments they no longer took."""
    blocks = [block for page in PAGES for block in runnable_blocks(page, RUNNABLE_TORCHRUN)]
    assert blocks and all(language == "python" for language, _ in blocks)
    for i, (_, code) in enumerate(blocks):
        script = tmp_path / f"script{i}.py"
        script.write_text(code)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
        command += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script)]
        run_block(command, tmp_path, code)


def documented_defaults(table: str, column: int) -> dict[str, str]:
    """Name -> default of an options table: the names backticked in cell ``column`` of a
    row (``| `beta1`, `momentum_window` | `0.9`, `32` |``), each with the backticked value
    at its place in the next cell, or the whole cell where the two counts differ."""
    defaults = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) <= column + 1:
            continue
        names = re.findall(r"`(-*[a-z][a-z0-9_-]*)`|`(--[a-z][a-z0-9-]*) \[", cells[column])
        names = [a or b for a, b in names]
        values = [v.strip('"') for v in re.findall(r"`([^`]+)`", cells[column + 1])]
        for j, name in enumerate(names):
            defaults[name] = values[j] if len(values) == len(names) else cells[column + 1]
    return defaults


def same_value(shown: str, value: object) -> bool:
    """A table's ``0.001``, ``1e-3``, ``on`` or ``"gaussian"`` for the code's value."""
    if isinstance(value, bool):
        return shown in ("on" if value else "off", str(value))
    if isinstance(value, (int, float)):
        try:
            return float(shown) == float(value)
        except ValueError:
            return False
    return shown == str(value)


def test_the_python_api_table_gives_every_zoconfig_field_its_default():
    """The table says it lists ZOConfig's fields; three were missing from it."""
    from distzo import ZOConfig

    text = (ROOT / "docs" / "python-api.md").read_text()
    shown = documented_defaults(text.split("`ZOConfig` fields and their defaults:", 1)[1], 0)
    wrong = [
        f"{field.name}: {shown.get(field.name, 'no row')} in the table, {field.default!r} in code"
        for field in dataclasses.fields(ZOConfig)
        if not same_value(shown.get(field.name, "no row"), field.default)
        and not (field.default is None and shown.get(field.name) == "None")
    ]
    assert not wrong, wrong


def test_the_training_page_gives_every_flag_with_its_default():
    """README.md sends the reader to training.md for every option: each flag of --help has a
    row there, and a row that shows one literal default shows the parser's."""
    shown = documented_defaults((ROOT / "docs" / "training.md").read_text(), 1)
    defaults = {
        "--" + key.replace("_", "-"): value
        for section in JobConfig().sections()
        for key, value in vars(getattr(JobConfig(), section)).items()
    }
    flags = {o for action in build_parser()._actions for o in action.option_strings}
    flags = {f for f in flags if f.startswith("--") and not f.startswith("--no-")} - {"--help"}
    assert not flags - set(shown), sorted(flags - set(shown))
    wrong = [
        f"{flag}: {shown[flag]} in the table, {defaults[flag]!r} in JobConfig"
        for flag in sorted(flags & set(defaults))
        if defaults[flag] is not None
        and re.fullmatch(r"[^ ]+", shown[flag])
        and not same_value(shown[flag], defaults[flag])
    ]
    assert not wrong, wrong


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_launch_config_resolves(config):
    """A recipe the docs hand out parses and passes the options' own checks."""
    job = resolve(["--config", str(config), "--output-dir", "run"])
    assert job.optim.max_steps > 0


def test_the_default_config_is_the_default_run_with_periodic_evaluations():
    """default.toml says every option in it is the default but its evaluations."""
    spelled = dataclasses.asdict(
        resolve(["--config", str(ROOT / "launch/configs/default.toml"), "--output-dir", "r"])
    )
    plain = dataclasses.asdict(resolve(["--output-dir", "r"]))
    differ = {
        f"{section}.{key}"
        for section in plain
        for key in plain[section]
        if spelled[section][key] != plain[section][key]
    }
    assert differ == {"run.eval_steps", "optim.lr"}  # lr: 1e-2, the tiny model's default
    assert spelled["optim"]["lr"] == 1e-2


# what the scripts write, not files of the repository
OUTPUTS = ("benchmarks/out", "benchmarks/data", "benchmarks/results")


def test_every_repository_path_the_docs_and_scripts_name_exists():
    """A path into the repository (``tests/...``, ``distzo/...``) in a page or a launch
    script's comments is one the reader can open: slurm.sbatch named its test where it
    was before tests/ was split into unit/ and integration/."""
    pattern = re.compile(r"(?<![\w./-])((?:distzo|tests|benchmarks|launch|docs|\.ci)/[\w./-]*\w)")
    missing = [
        f"{page.relative_to(ROOT)}: {path}"
        for page in [*PAGES, *LAUNCH_FILES, ROOT / "benchmarks" / "README.md"]
        for path in pattern.findall(page.read_text())
        if not path.startswith(OUTPUTS) and not (ROOT / path).exists()
    ]
    assert not missing, missing


class Planned(Exception):
    """The memory plan was made: stop before anything is allocated."""


def test_a_memory_plan_the_pages_quote_is_what_the_job_plans_on_cpu(tmp_path, monkeypatch):
    """A ``$ python -m distzo.train ...`` block that quotes its ``memory plan:`` line shows
    the plan the job makes for those options on a CPU (docs/models.md's OPT-175B plan kept
    an activation figure of an older estimate)."""
    from distzo.job import run_build
    from distzo.job.trainer import Trainer

    pattern = re.compile(r"^\$ python -m distzo\.train ([^\n]*)\n.*?memory plan: ([^\n]*)", re.M)
    quoted = [m.groups() for page in PAGES for m in pattern.finditer(page.read_text())]
    assert quoted

    def planned(plan, *_args):
        raise Planned(plan.describe())

    monkeypatch.setattr(run_build, "check_fits", planned)
    for i, (args, line) in enumerate(quoted):
        argv = [*args.split(), "--device", "cpu", "--output-dir", str(tmp_path / str(i))]
        with pytest.raises(Planned) as plan:
            Trainer(resolve(argv)).build()
        assert str(plan.value) == line, args


# a page's inline plan_report command and the first figure after it in its paragraph
INLINE_PLAN = re.compile(
    r"`python -m distzo\.job\.plan_report ([^`]+)`((?:(?!\n\n).)*?)(\d+\.\d+ [KMG]B)", re.S
)


def test_a_plan_report_command_in_the_prose_gives_the_device_total_it_prints(monkeypatch):
    """A page that names a plan_report command in a sentence and then a figure quotes the
    device total it prints (training.md's OPT-13B recipe kept 11.93 GB, an activation
    estimate of before; the command prints 9.31 GB)."""
    from distzo.job import plan_report

    for name in ("NCCL_BUFFSIZE", "NCCL_MAX_NCHANNELS", "NCCL_NVLS_ENABLE", "NCCL_NVLS_NCHANNELS"):
        monkeypatch.delenv(name, raising=False)  # the pages' figures are NCCL's defaults
    quoted = [
        (page.name, *m.group(1, 3))
        for page in PAGES
        for m in INLINE_PLAN.finditer(page.read_text())
    ]
    assert len(quoted) >= 2, quoted
    wrong = []
    for name, args, figure in quoted:
        text = plan_report.report(plan_report._parser().parse_args(args.split()))
        (line,) = [line for line in text.splitlines() if "device total" in line]
        total = " ".join(line.split()[-2:])
        if total != figure:
            wrong.append(f"{name}: {figure} quoted, {total} printed by: {' '.join(args.split())}")
    assert not wrong, wrong


def test_the_run_directory_names_every_field_a_step_record_holds(tmp_path):
    """training.md lists metrics.jsonl's fields and the dashboard's ``train/*`` numbers: a
    real record holds no field the list lacks (it lacked ``link_gb_per_s`` and
    ``objective``, and the dashboard's list ``train/step_s``)."""
    from distzo.job.trainer import Trainer

    flags = ["--max-steps", "1", "--device", "cpu", "--log-every", "0"]
    with Trainer(resolve([*flags, "--output-dir", str(tmp_path / "run")])) as trainer:
        trainer.train()
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    text = (ROOT / "docs" / "training.md").read_text()
    listed = text.split("* `metrics.jsonl`:", 1)[1].split("\n* ", 1)[0]
    unlisted = set(record) - set(re.findall(r"`([a-z_]+)`", listed))
    assert not unlisted, f"metrics.jsonl fields training.md does not list: {sorted(unlisted)}"
    dashboard = text.split("## The run's dashboard", 1)[1].split("\n\n")[1]  # its first paragraph
    numbers = {key for key, value in record.items() if isinstance(value, float)}
    unsent = numbers - set(re.findall(r"`train/([a-z_]+)`", dashboard))
    assert not unsent, f"train/* numbers training.md does not list: {sorted(unsent)}"


def test_the_python_api_names_every_field_of_a_step_result():
    """python-api.md spells out ``StepResult(...)``: the fields the engine returns, in their
    order (it left out ``stop``, the vote a torchrun loop stops on, and ``losses``)."""
    from distzo.engine.engine import StepResult

    text = (ROOT / "docs" / "python-api.md").read_text()
    (spelled,) = re.findall(r"`StepResult\(([^)]*)\)`", text)
    assert [name.strip() for name in spelled.split(",")] == [
        field.name for field in dataclasses.fields(StepResult)
    ]


@pytest.mark.parametrize("page", ["docs/benchmarks.md", "benchmarks/README.md"])
def test_the_scripts_said_to_take_quick_are_those_that_do(page):
    """The sentence on ``--quick`` names the scripts that take it, and only those: it said
    ``--quick`` runs each script, and model.py, pinned.py and peers.py refuse it."""
    text = (ROOT / page).read_text().replace("\n", " ")
    (sentence,) = [s for s in text.split(". ") if s.startswith("`--quick` runs ")]
    named = set(re.findall(r"`(\w+\.py)`", sentence.split(";")[0]))  # those before "take no"
    taking = {p.name for p in (ROOT / "benchmarks").glob("*.py") if '"--quick"' in p.read_text()}
    assert named == taking, sentence


def flags_in(text: str) -> set[str]:
    """The backticked flags a passage names (``--seed -1`` as ``--seed``)."""
    return set(re.findall(r"`(--[a-z][a-z0-9-]*)", text))


def test_the_resume_lists_name_every_option_of_the_run_once():
    """checkpoints.md lists the options a resume refuses a change to, those it accepts and
    those it retunes: together every option, each once, as run_dir decides (the refused
    list lacked --lozo-rank and --lozo-interval, which a resume refuses)."""
    from distzo.job.run_dir import INVOCATION, RESUME_MAY_CHANGE, RESUME_MAY_RETUNE

    text = (ROOT / "docs" / "checkpoints.md").read_text()
    refused_text = text.split("Those are every option of the model", 1)[1]
    refused_text, allowed_text = refused_text.split("The options that\n  leave", 1)
    allowed_text = allowed_text.split("`--lr` and `--eps` may change too", 1)[0]
    invocation = {"--" + name.replace("_", "-") for name in INVOCATION}
    options = {
        "--" + f.name.replace("_", "-")
        for section in JobConfig().sections().values()
        for f in dataclasses.fields(section)
    } - invocation
    allowed = {"--" + name.replace("_", "-") for name in RESUME_MAY_CHANGE}
    retuned = {"--" + name.replace("_", "-") for name in RESUME_MAY_RETUNE}
    assert flags_in(refused_text) - invocation == options - allowed - retuned
    assert flags_in(allowed_text) - invocation == allowed
    assert retuned == {"--lr", "--eps"}  # the sentence the allowed list ends at names them


def test_a_quoted_ignored_flag_warning_is_the_line_the_job_writes():
    """A page that quotes the warning on a flag the command makes meaningless quotes the
    job's own line (optimizers.md said such a LOZO flag was refused; it is ignored)."""
    from distzo.config.inapplicable import RULES, ignored_warning

    quoted = [
        line.split("WARNING distzo.train: ", 1)[1]
        for page in PAGES
        for line in page.read_text().splitlines()
        if "WARNING distzo.train: ignored: --" in line
    ]
    assert len(quoted) >= 2, quoted
    for line in quoted:
        names = [n.replace("-", "_") for n in re.findall(r"--([a-z0-9-]+) \(it applies", line)]
        assert line == ignored_warning({name: RULES[name][1] for name in names})


def spelled_parameters(spelled: str) -> list[tuple[str, str | None]]:
    """(name, default as written, or None) of a call a page spells, ``f(a, b=None)``."""
    parts = [part.partition("=") for part in " ".join(spelled.split()).split(",")]
    return [(name.strip(), default.strip() or None) for name, _, default in parts]


@pytest.mark.parametrize("call", ["ZOEngine", "engine.step", "export_hf", "Checkpointer"])
def test_a_signature_the_python_api_spells_is_the_codes(call):
    """python-api.md spells some calls with their parameters: they are the code's, in its
    order and with its defaults (a trailing optional one may be left out). export_hf's
    left out ``merged``, so a positional ``overwrite`` the page showed set it instead."""
    import inspect

    from distzo import ZOEngine
    from distzo.export.hf_model import export_hf
    from distzo.job.checkpoint import Checkpointer

    code = {
        "ZOEngine": ZOEngine.__init__,
        "engine.step": ZOEngine.step,
        "export_hf": export_hf,
        "Checkpointer": Checkpointer.__init__,
    }[call]
    text = (ROOT / "docs" / "python-api.md").read_text()
    (spelled,) = re.findall(rf"`(?:[\w.]*\.)?{re.escape(call)}\(([^`]*)\)`", text)
    shown = spelled_parameters(spelled)
    params = [p for p in inspect.signature(code).parameters.values() if p.name != "self"]
    actual = [
        (p.name, None if p.default is inspect.Parameter.empty else repr(p.default)) for p in params
    ]
    normalized = [(name, d.replace('"', "'") if d else d) for name, d in shown]
    assert normalized == actual[: len(shown)], (normalized, actual)
    assert all(default is not None for _, default in actual[len(shown) :]), actual


def test_the_overwrite_sentence_names_what_a_run_writes():
    """training.md names what ``--overwrite`` deletes: the run's own files and folders,
    run_dir's lists (what a fresh start is refused over and what --overwrite removes)."""
    from distzo.job.run_dir import RUN_FILES, RUN_FOLDERS

    text = " ".join((ROOT / "docs" / "training.md").read_text().split())
    sentence = text.split("`--overwrite` deletes the old run first", 1)[1].split("; anything", 1)[0]
    named = set(re.findall(r"`([\w.-]+/?)`", sentence.split("(and their", 1)[0]))
    assert named == {*RUN_FILES, "rankN.json", *(f"{folder}/" for folder in RUN_FOLDERS)}


def test_the_models_page_names_every_shape_and_family_the_code_has():
    """models.md lists the named shapes and quotes the error listing the families: both
    are the code's lists, which grow (a shape or family added would go unnamed)."""
    from distzo.models.registry import check_supported
    from distzo.models.shapes import SHAPES

    text = " ".join((ROOT / "docs" / "models.md").read_text().split())
    names = text.split("The names (`distzo/models/shapes.py`) are", 1)[1].split(". Each", 1)[0]
    assert set(re.findall(r"`([a-z0-9.-]+)`", names)) == set(SHAPES)
    (quoted,) = re.findall(r"error: (unsupported model type 'gpt_neox': [^\n]*?families)", text)
    with pytest.raises(ValueError) as refused:
        check_supported("gpt_neox")
    assert str(refused.value) == quoted


def test_the_python_api_names_every_supported_model_type():
    """python-api.md lists the model types ``load_model`` and ``model_from_config`` take:
    the registry's (it kept the six of before Phi-3, OLMo 2, Gemma and Granite)."""
    from distzo.models.registry import supported_model_types

    text = " ".join((ROOT / "docs" / "python-api.md").read_text().split())
    listed = text.split("The supported `model_type`s are", 1)[1].split("(", 1)[0]
    assert re.findall(r"`([a-z0-9_-]+)`", listed) == list(supported_model_types())
