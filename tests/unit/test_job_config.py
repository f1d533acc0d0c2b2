import tomllib
from pathlib import Path

import pytest

from distzo.config.job import JobConfig, build_parser, load_toml, resolve, to_toml, write_resolved
from tests.helpers.launch import train_in_process


def test_defaults_then_file_then_flags(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(
        '[optim]\nlr = 0.5\nmax_steps = 7\n[offload]\nmode = "resident"\n[run]\nresume = true\n'
    )
    job = resolve(["--config", str(path), "--max-steps", "9", "--eps", "0.01"])
    assert job.optim.lr == 0.5  # from the file
    assert job.optim.max_steps == 9  # the flag beats the file
    assert job.optim.eps == 0.01  # a flag alone
    assert (
        job.offload.mode == "resident" and job.run.resume == "yes"
    )  # the boolean of older files is the bare flag
    assert job.data.batch_size == JobConfig().data.batch_size  # untouched default


@pytest.mark.parametrize(
    "text, message",
    [
        ("[optim]\nlearning_rate = 1\n", "unknown key 'learning_rate' in \\[optim\\]"),
        ("[optimiser]\nlr = 1\n", "unknown section \\[optimiser\\]"),
        ("[optim]\nmax_steps = 'ten'\n", "max_steps must be a int"),
        ("[optim\nlr = 1\n", "not valid TOML"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        resolve(["--config", str(path)])
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
        for name, value in vars(values).items():
            assert "--" + name.replace("_", "-") in text
    flat = " ".join(text.split())
    assert "(default: 2000)" in flat and "(default: 1e-6, MeZO's, for --model" in flat
    assert "(default: None)" not in flat  # a None default is explained by the option's own text


@pytest.mark.parametrize("path", sorted(Path("launch/configs").glob("*.toml")))
def test_example_configs_name_only_known_options(path):
    load_toml(str(path))


def test_cli_reports_an_unknown_key_in_one_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optim]\nlr_max = 1\n")
    proc = train_in_process(["--config", str(path)])
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().startswith("error: --config")
        and len(proc.stderr.strip().splitlines()) == 1
    )
