"""Files a user is handed by someone else (data, seed logs, model folders): a hostile or
corrupt one is a one-line ``ValueError`` naming it, never a traceback of another kind."""

import json

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, OPTConfig, Qwen2Config

from distzo.config.engine_options import ZOConfig
from distzo.config.job import JobConfig, load_toml
from distzo.data.loaders import load_rows
from distzo.job import memory_plan
from distzo.job.run_dir import _recorded
from distzo.job.run_logs import iter_records, truncate_jsonl
from distzo.job.seed_log import read_seed_log
from distzo.models.config_file import ModelSize, model_size, read_config
from distzo.models.weights import SafetensorsWeights, TorchBinWeights, skeleton, weight_map
from distzo.runtime import json_text

DEEP = "[" * 100_000 + "]" * 100_000  # past Python's recursion limit, 200 kB


def test_json_nested_too_deeply_is_a_decode_error():
    with pytest.raises(json.JSONDecodeError, match=json_text.NESTED_TOO_DEEPLY):
        json_text.loads(DEEP)
    assert json_text.loads(b'{"a": [[1]]}') == {"a": [[1]]}
    with pytest.raises(json.JSONDecodeError, match=json_text.NESTED_TOO_DEEPLY):
        json_text.loads(DEEP.encode())  # bytes too, as json.loads takes them


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
    assert list(iter_records(metrics)) == [{"step": 0}, {"step": 3}]
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
    "shard",
    [
        "../other/model.safetensors",
        "/etc/passwd",
        "sub/../../model.safetensors",
        "..\\other\\model.safetensors",  # an index written on Windows
    ],
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
        ("a = " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
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


def test_a_config_json_transformers_reads_itself_nested_too_deeply_is_one_line(tmp_path):
    # a hub name's cached snapshot, or the file's own path, is read by transformers alone
    file = tmp_path / "config.json"
    file.write_text('{"model_type": "opt", "a": ' + DEEP + "}")
    with pytest.raises(ValueError, match=r"^cannot load --model .*config.json'?: maximum recurs"):
        read_config(file)


def model_folder(path, **config):
    """A folder holding only a config.json: ``config`` over a tiny OPT's."""
    path.mkdir()
    base = OPTConfig(
        vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2
    ).to_dict()
    (path / "config.json").write_text(json.dumps({**base, **config}))
    return path


@pytest.mark.parametrize(
    ("text", "kind"), [("null", "null"), ("[1, 2]", "an array"), ('"opt"', "a string")]
)
def test_a_config_json_that_is_not_an_object_is_one_line(tmp_path, text, kind):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"--model: .*config.json holds {kind}, not a model's"):
        read_config(tmp_path)


@pytest.mark.parametrize(
    ("value", "message"),
    [("12", "expected int, got str"), (2.5, "expected int, got float"), (None, "got NoneType")],
)
def test_a_config_json_field_of_the_wrong_type_is_one_line(tmp_path, value, message):
    folder = model_folder(tmp_path / "m", num_hidden_layers=value)
    with pytest.raises(ValueError, match=rf"--base {folder}: its config.json: .*{message}"):
        read_config(folder, "--base")


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (dict(num_hidden_layers=0), "num_hidden_layers 0; a model has one layer at least"),
        (dict(num_hidden_layers=-3), "num_hidden_layers -3; a model has one layer at least"),
        (dict(vocab_size=0), r"sizes build no model \(Padding_idx must be within"),
        (dict(num_attention_heads=5), r"sizes build no model \(embed_dim must be divisible"),
    ],
)
def test_config_sizes_that_build_no_model_are_one_line(tmp_path, sizes, message):
    config = read_config(model_folder(tmp_path / "m", **sizes))
    with pytest.raises(ValueError, match=rf"^--model m: its config.json.*{message}"):
        model_size(config, "--model m")


@pytest.mark.parametrize("family", ["opt", "llama", "gpt2", "qwen2"])
def test_model_size_counts_what_the_skeleton_holds(family):
    kinds = {
        "opt": OPTConfig(
            vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=5, num_attention_heads=2
        ),
        "llama": LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=5,
            num_attention_heads=2,
            tie_word_embeddings=False,
        ),
        "gpt2": GPT2Config(vocab_size=64, n_embd=16, n_layer=5, n_head=2),
        "qwen2": Qwen2Config(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=5,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
    }
    model = skeleton(kinds[family], torch.float32)
    size = model_size(kinds[family], family)
    assert size.parameters == sum(p.numel() for p in model.parameters())
    assert size.modules == sum(1 for _ in model.modules())
    assert kinds[family].num_hidden_layers == 5  # its cut models are copies


@pytest.mark.parametrize("layers", [1, 3])
def test_model_size_counts_a_qwen_of_fewer_layer_kinds_than_it_cuts(layers):
    # one entry of layer_types a layer: a one-layer model's is too short for the two-layer cut
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )
    model = skeleton(config, torch.float32)
    size = model_size(config, "--model q")
    assert size.parameters == sum(p.numel() for p in model.parameters())
    assert size.modules == sum(1 for _ in model.modules())


def test_a_config_of_a_million_layers_is_refused_before_its_skeleton(monkeypatch, caplog):
    # its skeleton built for an hour and took the host's memory before the plan could run
    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: 16 * 10**9)
    config = OPTConfig(
        vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=10**6, num_attention_heads=4
    )
    size = model_size(config, "--model big")
    assert size.modules == 11 * 10**6 + 8  # 11 a layer, and 8 of the model's own
    with pytest.raises(
        ValueError,
        match=r"^--model big: its config.json describes 8.54 B par.*"
        r"in 11.00 M modules, at least 36.04 GB \(1 byte a parameter.*the host "
        r"has 16.00 GB available\. Is its config.json damaged\?.*--force",
    ):
        memory_plan.check_weights_fit(size, 1, torch.device("cpu"), False, "--model big")
    memory_plan.check_weights_fit(size, 1, torch.device("cpu"), True, "--model big")
    assert "starting anyway (--force): --model big" in caplog.text


@pytest.mark.parametrize(
    ("master", "options", "each"),
    [
        (torch.float32, {}, 4),
        (torch.bfloat16, {}, 2),
        (torch.float32, {"transfer_dtype": "fp8"}, 1),
        (torch.float32, {"compute_dtype": "fp16"}, 2),
        (torch.float32, {"transfer_dtype": "bf16", "compute_dtype": "fp32"}, 2),
    ],
)
def test_the_weights_check_counts_the_fewest_bytes_any_copy_of_a_parameter_takes(
    master, options, each
):
    assert memory_plan.fewest_bytes_a_parameter(ZOConfig(**options), master) == each


def test_a_model_the_hosts_and_devices_memory_hold_together_is_not_refused(monkeypatch):
    # 36 GB of weights: more than the host's 16 GB, less than it and two 40 GB devices
    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: 16 * 10**9)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    props = type("Props", (), {"total_memory": 40 * 10**9})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    cuda = torch.device("cuda")
    assert memory_plan.node_memory_bytes(cuda) == (16 * 10**9, 80 * 10**9)
    assert memory_plan.node_memory_bytes(torch.device("cpu")) == (16 * 10**9, 0)
    size = ModelSize(parameters=36 * 10**9, modules=10)
    memory_plan.check_weights_fit(size, 1, cuda, False, "--model big")
    with pytest.raises(ValueError, match=r"the host has 16.00 GB available and 80.00 GB on its d"):
        memory_plan.check_weights_fit(size, 4, cuda, False, "--model big")


@pytest.mark.parametrize("kind", ["safetensors", "range", "bin", "bin range"])
def test_weights_of_other_shapes_than_the_config_name_the_file_and_the_fix(tmp_path, kind):
    from safetensors.torch import save_file

    state = {"model.decoder.layers.0.fc1.weight": torch.zeros(64, 32)}
    is_bin = kind.startswith("bin")
    file = tmp_path / ("pytorch_model.bin" if is_bin else "model.safetensors")
    torch.save(state, file) if is_bin else save_file(state, str(file))
    source = (TorchBinWeights if is_bin else SafetensorsWeights)(tmp_path)
    names, shape = ("model.decoder.layers.0.fc1.weight",), (128, 32)
    with pytest.raises(
        ValueError,
        match=rf"^{file}: checkpoint tensor .*fc1.weight has shape \(64, 32\), the model expects "
        rf"\(128, 32\) from {tmp_path}/config.json: the weights and config.json are of different",
    ):
        if kind.endswith("range"):
            source.tensor_range(names, shape, torch.float32, 0, 10)
        else:
            source.tensor(names, shape, torch.float32)


def test_a_model_config_json_nested_too_deeply_is_one_line(tmp_path):
    from distzo.config.job import resolve
    from distzo.dist import LaunchEnv
    from distzo.job.validation import model_config_of

    (tmp_path / "config.json").write_text('{"model_type": "opt", "a": ' + DEEP + "}")
    job = resolve(["--model", str(tmp_path)])
    with pytest.raises(ValueError, match=r"^--model: .*config.json is not JSON \(nested too deep"):
        model_config_of(job, LaunchEnv())
