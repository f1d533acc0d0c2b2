"""Bad input fails early with one line that names the option and the fix."""

import re

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from distzo import ZOConfig, ZOEngine, load_model, model_from_config
from distzo.job.checkpoint import Checkpointer
from tests.helpers.launch import train_in_process
from tests.helpers.models import random_batch, tiny_opt


@pytest.mark.parametrize(
    "options, option_named",
    [
        ({"eps": 0.0}, "eps"),
        ({"eps": -1e-3}, "eps"),
        ({"lr": -1e-6}, "lr"),
        ({"num_slots": 0}, "num_slots"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"lr_schedule": "cosine"}, "lr_schedule"),
        ({"lr_schedule": "linear"}, "max_steps"),
        ({"warmup_steps": -1}, "warmup_steps must be >= 0, got -1"),  # else a shifted decay
        ({"mode": "disk"}, "mode"),
        ({"noise_chunk": 0}, "noise_chunk"),
        ({"device": "tpu:x"}, "device"),
        ({"transfer": "sliced", "mode": "resident"}, "transfer sliced"),
        ({"transfer": "ring"}, "transfer"),
        ({"transfer_dtype": "int4"}, "transfer_dtype"),
        ({"compute_dtype": "fp8"}, "compute_dtype"),
        ({"num_queries": 0}, "num_queries"),
        ({"lr": "1e-3"}, "lr must be a number, got '1e-3'"),  # YAML reads 1e-3 as text
        ({"num_slots": 2.5}, "num_slots must be a whole number, got 2.5"),
        ({"dual_forward": 1}, "dual_forward must be True or False"),
        ({"seed": 2**64 + 5}, "seed must be in \\[0, 2\\^63\\)"),  # once seed 5's noise
    ],
)
def test_invalid_options_name_themselves(options, option_named):
    with pytest.raises(ValueError, match=option_named) as info:
        ZOConfig(**options)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
@pytest.mark.parametrize(
    "options, message",
    [
        ({"seed": 2**63}, "seed must be in \\[0, 2\\^63\\)"),
        ({"optimizer": "momentum", "momentum_window": 257}, "momentum_window must be in"),
        (
            {
                "optimizer": "momentum",
                "optimizer_state": "stored",
                "transfer_dtype": "bf16",
                "low_bit_master": "recompute",
            },
            "low_bit_master recompute applies the update again for each pass",
        ),
        (
            {"perturb_scope": "module", "batch_queries": True, "num_queries": 2},
            "perturb_scope module perturbs a trained block's modules one pass at a time",
        ),
    ],
)
def test_options_just_past_what_the_engine_takes_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ZOConfig(device="cpu", **options)


def test_the_engines_bounds_themselves_are_taken():
    ZOConfig(device="cpu", seed=2**63 - 1)
    ZOConfig(device="cpu", optimizer="momentum", momentum_window=256)


def test_cuda_without_cuda_is_refused():
    with pytest.raises(ValueError, match="CUDA is not available"):
        ZOConfig(device="cuda")


def test_one_slot_is_valid_and_trains():
    engine = ZOEngine(tiny_opt(), ZOConfig(num_slots=1, device="cpu", seed=0))
    ids = torch.randint(3, 64, (2, 8))
    assert engine.step({"input_ids": ids}).step == 0


def tiny_neox():
    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        )
    )


@pytest.mark.parametrize(
    "config, got", [({"model_type": "opt"}, "dict {'model_type': 'opt'}"), ("x", "str 'x'")]
)
def test_model_from_config_refuses_what_is_no_config_in_one_line(config, got):
    """A dict or a hub name was "'dict' object has no attribute 'model_type'"."""
    with pytest.raises(
        TypeError,
        match=rf"^config must be a transformers PretrainedConfig, got "
        rf"{re.escape(got)}: AutoConfig.from_pretrained\(name_or_path\)",
    ):
        model_from_config(config)


@pytest.mark.parametrize("asynchronous", ["no", 0, None])
def test_a_save_whose_asynchronous_is_no_bool_is_refused_before_writing(tmp_path, asynchronous):
    """asynchronous="no" was truthy: the save went to a thread, and step-N stayed step-N.tmp
    until a wait the caller, who asked for a save done on return, never made."""
    checkpointer = Checkpointer(tmp_path, ZOEngine(tiny_opt(), ZOConfig(device="cpu")))
    with pytest.raises(TypeError, match=r"^asynchronous must be True or False, got .*: True wr"):
        checkpointer.save(asynchronous=asynchronous)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("keep", [2.5, "3", -1, True, None])
def test_a_checkpointer_whose_keep_is_no_count_is_refused_at_construction(tmp_path, keep):
    """keep=2.5 or "3" failed at the first prune, after the save's work (a float is no slice
    index, a string no number); keep=-1 silently kept every checkpoint."""
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu"))
    with pytest.raises(TypeError, match=r"^keep must be a whole number >= 0, got .*: the comp"):
        Checkpointer(tmp_path, engine, keep)
    assert Checkpointer(tmp_path, engine, 2).keep == 2


def test_unsupported_model_type_lists_the_supported_ones():
    with pytest.raises(
        ValueError,
        match=r"unsupported model type 'gpt_neox': distzo supports gemma, gemma2, gemma3_text, "
        r"gpt2, granite, llama, mistral, mixtral, olmo2, olmoe, opt, phi3, qwen2, qwen2_moe, "
        r"qwen3, qwen3_moe, roberta, xlm-roberta;",
    ) as info:
        ZOEngine(tiny_neox(), ZOConfig(device="cpu"))
    assert "\n" not in str(info.value)


def test_unsupported_checkpoint_fails_before_loading_weights(tmp_path):
    tiny_neox().config.save_pretrained(
        tmp_path
    )  # a config and no weights: loading them would fail differently
    with pytest.raises(ValueError, match="unsupported model type 'gpt_neox'"):
        load_model(str(tmp_path))


def test_load_model_takes_the_dtype_names_of_dtype_and_refuses_others_in_one_line(tmp_path):
    """dtype="bf16" (or "fp32", the name --dtype takes) failed in transformers with "module
    'torch' has no attribute 'bf16'"; load_model(3) with "expected str, bytes or
    os.PathLike object, not int"."""
    tiny_opt().save_pretrained(tmp_path)
    assert load_model(tmp_path, dtype="fp64").dtype == torch.float64
    assert load_model(str(tmp_path), dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"^dtype 'bf16' is not a .* one of fp32, fp64, auto$"):
        load_model(tmp_path, dtype="bf16")
    with pytest.raises(ValueError, match=r"^dtype torch.int8 is not a floating-point dtype"):
        model_from_config(tiny_opt().config, dtype=torch.int8)
    with pytest.raises(TypeError, match=r"^load_model takes a hub name or a local .* int 3$"):
        load_model(3)


def run_cli(*args):
    return train_in_process(list(args))


@pytest.mark.parametrize(
    "args, named",
    [
        (["--eps", "0"], "eps"),
        (["--num-slots", "0"], "--num-slots must be >= 1"),
        (["--lr", "-1"], "lr"),
        (["--lr", "-1e-3"], "lr must be >= 0, got -0.001"),  # not "expected one argument"
        (["--eps", "-.5E2"], "eps must be > 0"),
        (["--seq-len", "100"], "--seq-len"),
        (["--model", "/no/such/model"], "--model"),
        (["--export-shard-size", "big"], "--export-shard-size"),
        (["--export-shard-size", "0GB"], "--export-shard-size '0GB' is not a size"),
        (["--output-dir", ""], "--output-dir is empty; give a path or leave it out"),
        (["--config", ""], "--config is empty"),
        (["--num-queries", "0"], "--num-queries must be >= 1"),
        (["--seq-len", "1"], "--seq-len must be >= 2"),
        (["--seq-len", "-3"], "--seq-len must be >= 2"),
        (["--lr", "inf"], "--lr must be a finite number"),
        (["--lr", "1e300"], "--lr must be a finite number"),
        (["--weight-decay", "inf"], "--weight-decay must be a finite number"),
        (["--eps", "nan"], "--eps must be a finite number"),
        (["--eps", "1e-300"], "eps must be at least 1.18e-38 (float32's smallest normal"),
        (["--optimizer", "adam", "--adam-eps", "inf"], "--adam-eps must be a finite number"),
        (["--seed", str(2**64)], "--seed must be -1 (draw one) or in [0, 2^63)"),
        (["--seed", "-2"], "--seed must be -1"),
        (["--dist-timeout", "0"], "--dist-timeout must be a positive number"),
        (["--dist-timeout", "nan"], "--dist-timeout must be a positive number"),
        (["--device", "mps"], "distzo runs on CUDA or the CPU"),
        (["--device", "meta"], "distzo runs on CUDA or the CPU"),
        (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs CUDA devices; use "),
        (
            [
                "--task",
                "text",
                "--train-file",
                __file__,
                "--eval-file",
                __file__,
                "--max-length",
                "1",
            ],
            "--max-length 1 leaves no next token to predict",
        ),  # fmt: skip
    ],
)
def test_cli_rejects_bad_input_with_one_line_and_exit_2(args, named):
    proc = run_cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: {**b, "labels": b["input_ids"][:, 1:]}, "labels must have input_ids' shape"),
        (lambda b: {**b, "labels": b["labels"][:3]}, "labels must have input_ids' shape"),
        (lambda b: {**b, "attention_mask": b["attention_mask"][:, :-1]}, "attention_mask must"),
        (lambda b: {"input_ids": b["input_ids"][0]}, "input_ids must be a 2-D tensor"),
        (lambda b: {"input_ids": b["input_ids"].float()}, "input_ids must be a 2-D tensor"),
        (lambda b: {**b, "input_ids": b["input_ids"].to(torch.uint8)}, "int64 or int32 token"),
        (lambda b: {**b, "input_ids": b["input_ids"].bool()}, "int64 or int32 token"),
    ],
)
def test_a_malformed_batch_is_refused_and_leaves_the_engine_usable(change, message):
    """Labels of another shape trained silently (or failed inside, leaving the engine
    unusable, as a 1-D or float input_ids did, and uint8 or bool ids, which the embedding
    does not look up): refused before anything runs."""
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0, mode="resident"))
    batch = random_batch(64, batch=4, pad="left", seed=0)
    for run in (engine.step, engine.forward):
        with pytest.raises(ValueError, match=message):
            run(change(batch))
    assert engine.step(batch).step == 0


def test_a_model_put_in_training_mode_is_stepped_in_eval_mode(caplog):
    """Dropout (OPT's 0.1) made the two passes two functions: g was noise."""
    engines = [ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0)) for _ in range(2)]
    engines[1].model.train()
    batch = random_batch(64, seed=1)
    with caplog.at_level("WARNING"):
        results = [engine.step(batch) for engine in engines]
    assert results[0].projected_grads == results[1].projected_grads
    assert not engines[1].model.training and "put back in eval mode" in caplog.text


def test_a_meta_model_without_weights_is_one_line():
    from distzo.models.weights import skeleton

    with pytest.raises(ValueError, match="on the meta device .* pass weights="):
        ZOEngine(skeleton(tiny_opt().config, torch.float32), ZOConfig(device="cpu", seed=0))


@pytest.mark.parametrize("scope, adapter", [("block", False), ("module", False), ("block", True)])
def test_a_second_engine_on_a_model_an_engine_bound_is_one_line(scope, adapter):
    """The first engine's binding left the model's parameters views of its scratch: a second
    engine packed them (the last perturbed block's values) and evaluated 4.1225 where the
    first stood at 4.1548 and a fresh model at 4.1442, without a word; under the module
    scope it failed at its first forward with advice about the first engine's pass."""
    from tests.helpers.models import adapted

    model = adapted("opt", "lora") if adapter else tiny_opt()
    first = ZOEngine(model, ZOConfig(device="cpu", seed=0, perturb_scope=scope))
    first.step(random_batch(64, seed=1))
    with pytest.raises(ValueError, match="^this model is already bound to a ZOEngine .* fresh"):
        ZOEngine(model, ZOConfig(device="cpu", seed=0))
    first.step(random_batch(64, seed=1))  # the first engine is untouched by the refusal


def test_an_engine_refused_before_binding_leaves_the_model_to_the_next(monkeypatch):
    """An adapter under perturb_scope module was refused only after every bucket had been
    filled (a checkpoint read whole) and, once refusals marked a bound model, left it
    marked; it is refused before any bucket now, and the model stays the user's."""
    from distzo.engine import parts
    from tests.helpers.models import adapted

    model = adapted("opt", "lora")
    filled = []
    fill = parts.fill_store
    monkeypatch.setattr(parts, "fill_store", lambda *args: filled.append(args) or fill(*args))
    with pytest.raises(ValueError, match="an adapter's base is never perturbed"):
        ZOEngine(model, ZOConfig(device="cpu", seed=0, perturb_scope="module"))
    assert not filled
    ZOEngine(model, ZOConfig(device="cpu", seed=0)).step(random_batch(64, seed=1))


def test_engine_refuses_sequences_longer_than_the_model_allows():
    engine = ZOEngine(tiny_opt(), ZOConfig(device="cpu", seed=0))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.step({"input_ids": torch.randint(3, 64, (1, 65))})


def test_a_flag_warned_as_ignored_is_not_refused_after_the_warning(caplog):
    """The warning says the flag is ignored: the engine's own checks (LOZO's options only
    with low-rank noise, the sliced transfer only offloaded) must not refuse it next."""
    from distzo.config.job import resolve

    with caplog.at_level("WARNING", logger="distzo.train"):
        argv = ["--mode", "resident", "--transfer", "sliced"]
        job = resolve([*argv, "--lozo-rank", "3", "--lozo-interval", "7"])
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "--lozo-rank" in warning and "--lozo-interval" in warning
    job.validate()
    config = job.engine_config("cpu")
    assert (config.lozo_rank, config.lozo_interval) == (2, 50)
    assert job.offload.transfer == config.transfer == "auto"
    # applicable, they are kept and reach the engine
    config = resolve(["--estimator", "lozo", "--lozo-rank", "3"]).engine_config("cpu")
    assert config.lozo_rank == 3


def test_flags_the_command_makes_meaningless_are_named_in_one_warning(caplog):
    from distzo.config.job import resolve

    argv = ["--beta2", "0.9", "--lora-r", "4", "--mode", "resident", "--num-slots", "2"]
    with caplog.at_level("WARNING", logger="distzo.train"):
        resolve([*argv, "--max-new-tokens", "4", "--optimizer", "momentum"])
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == (  # in --help's order
        "ignored: --max-new-tokens (it applies only with --task squad or drop), "
        "--beta2 (it applies only with --optimizer adam), "
        "--lora-r (it applies only with --peft lora or lora-fa), "
        "--num-slots (it applies only with --mode offload)"
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="distzo.train"):
        resolve(["--optimizer", "adam", "--beta2", "0.99", "--peft", "lora", "--lora-r", "4"])
        resolve(["--estimator", "lozo", "--lozo-rank", "2", "--lozo-interval", "50"])
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    # the defaults' own values, which the engine's check cannot tell from unset
    with caplog.at_level("WARNING", logger="distzo.train"):
        resolve(["--lozo-rank", "2", "--lozo-interval", "50"])
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "--lozo-rank (it applies only with --noise lowrank (--estimator lozo))" in warning
    assert "--lozo-interval" in warning
    caplog.clear()  # one query has nothing to batch with (FZOO's 8 and --num-queries 2 have)
    with caplog.at_level("WARNING", logger="distzo.train"):
        resolve(["--peft", "lora-fa", "--batch-queries"])
        resolve(["--peft", "lora-fa", "--batch-queries", "--estimator", "fzoo"])
        resolve(["--peft", "lora-fa", "--batch-queries", "--num-queries", "2"])
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == (
        "ignored: --batch-queries (it applies only with several queries a step (--num-queries "
        "2 or more))"
    )
    # full tuning cannot batch at any count: refused as with --num-queries 2, not ignored
    for queries in ("1", "2"):
        argv = ["--batch-queries", "--num-queries", queries]
        with pytest.raises(ValueError, match="^--dual-forward and --batch-queries need an adapter"):
            resolve(argv).validate()
    caplog.clear()  # an adapter's export is adapter_model.safetensors, never sharded
    with caplog.at_level("WARNING", logger="distzo.train"):
        resolve(["--peft", "lora", "--merge-adapter", "--export-shard-size", "1GB"])
        resolve(["--export-shard-size", "1GB"])
        job = resolve(["--peft", "prefix", "--export-shard-size", "1GB"])
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == (
        "ignored: --export-shard-size (it applies only with --peft none or --merge-adapter "
        "(an adapter exports as one file))"
    )
    assert job.run.export_shard_size == "5GB"


def test_transfer_chunks_under_the_naive_transfer_are_named_as_ignored(caplog):
    """Only the sliced transfer stripes a rank's slice into pieces: --transfer-chunks with
    --transfer naive did nothing, silently (auto may resolve to sliced: kept)."""
    from distzo.config.job import resolve

    chunks = ["--transfer-chunks", "2"]
    with caplog.at_level("WARNING", logger="distzo.train"):
        assert resolve(chunks).offload.transfer_chunks == 2
        assert resolve([*chunks, "--transfer", "sliced"]).offload.transfer_chunks == 2
        job = resolve([*chunks, "--transfer", "naive"])
        resident = resolve([*chunks, "--mode", "resident"])  # no block travels at all
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == 2 * [
        "ignored: --transfer-chunks (it applies only with --mode offload and --transfer "
        "sliced or auto)"
    ]
    assert job.offload.transfer_chunks == resident.offload.transfer_chunks == 4


def test_an_engine_option_outside_its_choices_names_them_and_its_hint():
    """The engine's choice check names the option as its caller spelled it (the API's
    field, the command line's flag), every choice, and the option's hint."""
    from distzo.config.engine_checks import check_options
    from distzo.config.engine_options import ZOConfig
    from distzo.runtime.option_names import named_as_flags

    with pytest.raises(ValueError) as refused:
        check_options(ZOConfig(noise="uniform"))
    assert str(refused.value) == (
        "noise must be one of gaussian, rademacher, legacy, lowrank, got 'uniform'; gaussian "
        "is MeZO's z, rademacher SPSA's +-1"
    )
    with named_as_flags(), pytest.raises(ValueError, match="^--noise must be one of gaussian"):
        check_options(ZOConfig(noise="uniform"))
    for name, choices in [
        ("optimizer_state", "auto, recomputed, stored, lowrank"),
        ("state_dtype", "fp32, bf16"),
    ]:
        with pytest.raises(ValueError) as refused:
            check_options(ZOConfig(**{name: "bogus"}))
        assert str(refused.value) == f"{name} must be one of {choices}, got 'bogus'"


def test_a_momentum_window_with_stored_momentum_is_named_as_ignored(caplog):
    """A stored momentum is one buffer, not a window of recomputed steps: --momentum-window
    does nothing there, so it is warned about and set back (recomputed, it is kept)."""
    from distzo.config.job import resolve

    momentum = ["--optimizer", "momentum", "--momentum-window", "5"]
    with caplog.at_level("WARNING", logger="distzo.train"):
        assert resolve(momentum).optim.momentum_window == 5
        job = resolve([*momentum, "--optimizer-state", "stored"])
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == (
        "ignored: --momentum-window (it applies only with --optimizer momentum with its state "
        "recomputed)"
    )
    assert job.optim.momentum_window == 32


def test_the_engine_names_a_field_for_the_api_and_a_flag_for_the_command_line():
    from distzo.config.job import resolve

    api = "state_dtype bf16 applies to stored optimizer state at rest in host memory"
    with pytest.raises(ValueError, match=api):
        ZOConfig(device="cpu", state_dtype="bf16")
    job = resolve(["--state-dtype", "bf16", "--optimizer", "momentum"])
    with pytest.raises(ValueError) as refused:
        job.engine_config("cpu")
    assert str(refused.value) == (
        "--state-dtype bf16 applies to stored optimizer state at rest in host memory "
        "(--optimizer adam, or momentum with --optimizer-state stored, in --mode offload; "
        "lowrank's factors stay on the device); use --state-dtype fp32"
    )
    with pytest.raises(ValueError, match=api):  # the API's names again after the job's build
        ZOConfig(device="cpu", state_dtype="bf16")


@pytest.mark.parametrize("method", ["lora", "lora-fa"])
def test_lora_on_a_family_peft_has_no_default_for_needs_targets_up_front(tmp_path, method):
    """peft has no default LoRA targets for Granite (nor Phi-3, OLMo 2): the run built the
    model's skeleton before peft said so; it is now refused from the config alone, and the
    same run with --lora-targets is taken."""
    from tests.helpers.models import build

    build("granite").config.save_pretrained(tmp_path / "model")  # a config, no weights
    run = tmp_path / "run"
    flags = ["--model", str(tmp_path / "model"), "--peft", method, "--output-dir", str(run)]
    proc = run_cli(*flags)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: --peft {method}: peft has no default target modules for model type "
        "'granite'; name them with --lora-targets (the attention projections, such as "
        "q_proj,v_proj, or Phi-3's qkv_proj)"
    )
    assert not run.exists()
    from distzo.adapters.peft_adapters import AdapterSpec

    AdapterSpec(method, targets=("q_proj",)).check_default_targets("granite")
    AdapterSpec(method).check_default_targets("llama")  # peft's q_proj,v_proj
    AdapterSpec("prefix").check_default_targets("granite")


def test_a_refusal_names_a_long_value_in_one_short_line(tmp_path):
    """A flag given a long list (or a model) is named by its type and a short repr, not
    pages of it; the line still ends with what the argument means."""
    from distzo.runtime.argument_values import check_flag

    with pytest.raises(TypeError) as err:
        check_flag(list(range(10_000)), "overwrite", "pass overwrite=True to replace it")
    message = str(err.value)
    assert message.startswith("overwrite must be True or False, got list [0, 1, 2, 3, 4, 5, ")
    assert message.endswith(": pass overwrite=True to replace it")
    assert len(message) < 150 and "\n" not in message
