"""Files a user is handed by someone else (data, seed logs, model folders): a hostile or
corrupt one is a one-line ``ValueError`` naming it, never a traceback of another kind."""

import json

import pytest
import torch
from transformers import OPTConfig

from distzo.config.job import JobConfig, load_toml
from distzo.data.loaders import load_rows
from distzo.job.run_dir import _recorded
from distzo.job.run_logs import iter_records, truncate_jsonl
from distzo.job.seed_log import read_seed_log
from distzo.models.weights import skeleton, weight_map
from distzo.runtime import json_text

DEEP = "[" * 100_000 + "]" * 100_000  # past Python's recursion limit, 200 kB


def test_json_nested_too_deeply_is_a_decode_error():
    with pytest.raises(json.JSONDecodeError, match=json_text.NESTED_TOO_DEEPLY):
        json_text.loads(DEEP)
    assert json_text.loads(b'{"a": [[1]]}') == {"a": [[1]]}


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("rows.jsonl", '{"text": "ok"}\n{"text": ' + DEEP + "}\n", "rows.jsonl, row 2: not valid"),
        ("rows.json", '[{"text": ' + DEEP + "}]", "rows.json: not valid JSON"),
    ],
)
def test_a_data_file_nested_too_deeply_is_one_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_rows(str(path))


def test_a_seed_log_line_nested_too_deeply_is_one_line(tmp_path):
    log = tmp_path / "seedlog.jsonl"
    log.write_text('{"kind": "header", "run_seed": 0}\n{"step": ' + DEEP + "}\n")
    with pytest.raises(ValueError, match="line 2: not JSON"):
        read_seed_log(log)


def test_a_model_index_nested_too_deeply_is_one_line(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + DEEP + "}")
    with pytest.raises(ValueError, match="not a model index"):
        weight_map(index)


def test_run_logs_skip_lines_nested_too_deeply_or_not_records(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0}\n' + DEEP + '\n5\n["step"]\n{"step": "x"}\n{"step": 3}\n')
    assert list(iter_records(metrics)) == [{"step": 0}, {"step": "x"}, {"step": 3}]
    truncate_jsonl(metrics, keep_below=2)
    assert metrics.read_text() == '{"step": 0}\n'


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("optimizer", "sgd", "header's optimizer is 'sgd', not a JSON object"),
        ("peft", "lora", "header's peft is 'lora', not a JSON object"),
        ("lowrank", "x", "header's lowrank is 'x', not a JSON object"),
        ("model", ["opt"], r"header's model is \['opt'\], not a JSON object"),
        ("base", 5, "header's base is 5, not a string"),
        ("first_step", [1], r"header's first_step is \[1\], not a whole number"),
        ("first_step", "abc", "header's first_step is 'abc', not a whole number"),
        ("first_step", -2, "header has first_step -2, not a step number"),
        ("first_step", 1.5, "header's first_step is 1.5, not a whole number"),
    ],
)
def test_a_seed_log_header_field_of_the_wrong_type_is_one_line(tmp_path, field, value, message):
    log = tmp_path / "seedlog.jsonl"
    header = {"kind": "header", "run_seed": 0, field: value}
    log.write_text(json.dumps(header) + "\n")
    with pytest.raises(ValueError, match=message):
        read_seed_log(log)


def test_a_seed_log_header_as_distzo_writes_it_reads(tmp_path):
    log = tmp_path / "seedlog.jsonl"
    header = {"kind": "header", "first_step": 2, "base": "b", "model": {}, "peft": None}
    record = {"step": 2, "projected_grads": [0.5], "lr": 0.1}
    log.write_text(json.dumps(header) + "\n" + json.dumps(record) + "\n")
    assert read_seed_log(log) == (header, [record])


@pytest.mark.parametrize(
    "shard", ["../other/model.safetensors", "/etc/passwd", "sub/../../model.safetensors"]
)
def test_a_model_index_naming_a_file_outside_its_folder_is_one_line(tmp_path, shard):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-1.safetensors", "b": shard}}))
    with pytest.raises(ValueError, match="a file outside the model's folder"):
        weight_map(index)


def test_a_model_index_naming_its_own_files_reads(tmp_path):
    # (the hub cache's files are links out of the folder: a name is checked, not its target)
    names = {"a": "model-1.safetensors", "b": "sub/model-2.safetensors"}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": names}))
    assert weight_map(index) == names


@pytest.mark.parametrize(
    ("vocab", "reason"),
    [(2**62, "Storage size calculation overflowed"), (-5, "Padding_idx must be within")],
)
def test_a_config_whose_sizes_no_tensor_has_is_one_line(vocab, reason):
    config = OPTConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1, ffn_dim=8)
    config.name_or_path = "handed/model"
    with pytest.raises(ValueError, match=rf"handed/model: its config's sizes .*\({reason}"):
        skeleton(config, torch.float32)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("data = 5\n", r"records data = 5, not a \[data\] table"),
        ("a = " + "[" * 5000 + "]" * 5000 + "\n", "maximum recursion depth"),
    ],
)
def test_a_runs_config_toml_of_the_wrong_shape_is_one_line_on_resume(tmp_path, text, message):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"--resume: .*{message}"):
        _recorded(JobConfig(), path)


def test_a_config_file_nested_too_deeply_is_one_line(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ValueError, match="not valid TOML .nested too deeply"):
        load_toml(str(path))
