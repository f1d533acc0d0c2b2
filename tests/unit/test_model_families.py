"""Every adapter's blockwise forward equals the model's own forward; the engine's
trajectory does not depend on the family's quirks (offload == resident)."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from distzo import ZOConfig, ZOEngine, family_for
from distzo.models import supported_model_types
from tests.helpers.models import CONFIGS, build, random_batch


def test_every_family_is_registered():
    assert set(supported_model_types()) == {
        *("opt", "llama", "qwen2", "qwen3", "mistral", "gpt2"),
        *("phi3", "olmo2", "gemma", "gemma2", "gemma3_text", "granite"),
        *("qwen3_moe", "qwen2_moe", "mixtral", "olmoe"),
        *("roberta", "xlm-roberta"),
    }


def test_the_model_options_help_names_every_family():
    """``--help`` names every family --model takes: it said --model takes opt,
    llama, qwen2, qwen3, mistral and gpt2 after Gemma, Granite, Phi-3 and OLMo 2 were added
    (the help is text: --help loads no registry)."""
    import dataclasses

    from distzo.config.job import ModelOptions

    (model,) = [f for f in dataclasses.fields(ModelOptions) if f.name == "model"]
    named = model.metadata["help"].partition("(")[2].partition(")")[0].split(", ")
    assert sorted(named) == supported_model_types()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("pad", [None, "left", "right"])
def test_blockwise_forward_equals_the_model_forward(name, pad):
    model = build(name, seed=1)
    batch = random_batch(64, pad=pad, seed=2)
    with torch.no_grad(), warnings.catch_warnings():
        reference = model(**batch)
        # the cache reaches the layers and mask builders by the installed transformers'
        # keyword: a deprecated one would warn on every forward of every run
        warnings.simplefilter("error", FutureWarning)
        logits, loss = family_for(model).forward(
            batch["input_ids"], batch["attention_mask"], batch["labels"]
        )
    keep = batch["attention_mask"].bool()  # padded positions may hold anything
    assert (logits - reference.logits)[keep].abs().max().item() <= 1e-5
    assert torch.allclose(loss, reference.loss, rtol=1e-6)


@pytest.mark.parametrize(
    "name",
    ["llama", "qwen2_sliding", "gpt2", "gemma3", "granite", "qwen3_moe", "qwen2_moe", "mixtral"],
)
def test_offload_trajectory_equals_resident(name):
    runs = {}
    for mode in ("offload", "resident"):
        engine = ZOEngine(
            build(name),
            ZOConfig(
                mode=mode,
                lr=1e-3,
                eps=1e-3,
                weight_decay=0.1,
                seed=4,
                device="cpu",
                noise_chunk=500,
            ),
        )
        results = [engine.step(random_batch(64, pad="left", seed=i)) for i in range(6)]
        runs[mode] = (
            [(r.loss_plus, r.loss_minus, r.projected_grad) for r in results],
            engine.named_parameters(),
        )
    assert runs["offload"][0] == runs["resident"][0]
    for key, value in runs["resident"][1].items():
        assert torch.equal(runs["offload"][1][key], value), key


def test_tied_heads_are_one_parameter():
    for name in ("llama_tied", "gpt2"):
        engine = ZOEngine(build(name), ZOConfig(device="cpu", seed=0))
        params = engine.named_parameters()
        head = "lm_head.weight"
        tied = [k for k in params if k != head and params[k] is params[head]]
        assert len(tied) == 1, (name, tied)
    untied = ZOEngine(build("llama"), ZOConfig(device="cpu", seed=0)).named_parameters()
    assert untied["lm_head.weight"] is not untied["model.embed_tokens.weight"]


def test_strategy_invariance_for_a_tiny_llama(tmp_path):
    from tests.helpers.launch import Run, python_train, torchrun

    build("llama", seed=3).save_pretrained(tmp_path / "llama")
    common = [
        "--model",
        str(tmp_path / "llama"),
        "--max-steps",
        "6",
        "--batch-size",
        "8",
        "--log-every",
        "0",
        "--dtype",
        "fp64",
        "--lr-schedule",
        "constant",
        "--lr",
        "1e-2",
    ]
    single = tmp_path / "single"
    assert python_train(common + ["--output-dir", str(single)]).returncode == 0
    runs = {}
    for name, flags in {"pertp": ["--pert", "2"], "ddp": ["--pert", "1"]}.items():
        out = tmp_path / name
        proc = torchrun(2, common + flags + ["--output-dir", str(out)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = Run(out)
    reference = Run(single)
    assert runs["pertp"].grads == reference.grads  # nothing is split: bitwise
    # DDP splits the batch. Llama's RMSNorm and rotary tables compute in fp32 even in an
    # fp64 model, so the split's reassociation surfaces at fp32 rounding (measured ~6e-7
    # in g, after the 1/(2 eps) magnification) instead of fp64's ~1e-12.
    a = runs["ddp"]
    assert max(abs(x - y) / abs(y) for x, y in zip(a.grads, reference.grads)) <= 1e-5
    for key, value in reference.params.items():
        assert ((a.params[key] - value).norm() / value.norm()).item() <= 1e-5, key


def test_a_multimodal_gemma_3_in_a_text_model_api_names_what_distzo_trains():
    """Gemma 3 4B and larger are multimodal (model type gemma3): a text-model API
    (``model_from_config``, ``load_model``) says that --model trains such a checkpoint's
    language model, and which Gemma 3 models are text models."""
    from distzo.models import check_supported

    with pytest.raises(ValueError) as err:
        check_supported("gemma3")
    assert str(err.value).startswith(
        "unsupported model type 'gemma3' (a multimodal model: distzo trains the language "
        "model of such a checkpoint given as --model, and Gemma 3's text-only models (1B, "
        "model type gemma3_text)): distzo supports gemma, "
    )


def test_a_bidirectional_gemma_is_refused_from_its_config_and_its_model(tmp_path):
    """EmbeddingGemma's config (use_bidirectional_attention) is a Gemma 3 model type whose
    layers attend both ways: the engine's causal masks would train another model than the
    one saved. The job refuses it from config.json alone (before any weights are looked
    for), and the Python API as its family wraps the model."""
    config = CONFIGS["gemma3"]()
    config.use_bidirectional_attention = True
    message = (
        "this Gemma config sets use_bidirectional_attention (an embedding model, "
        "not a causal LM); pick a causal Gemma model"
    )
    refused_as_wrapped_and_from_its_config(config, message, tmp_path)


def refused_as_wrapped_and_from_its_config(config, message: str, tmp_path) -> None:
    """``config`` is refused with ``message`` as the family wraps its model, and as a
    --model folder holding it alone, in one line before any run directory is made."""
    from tests.helpers.launch import train_in_process

    with pytest.raises(ValueError) as err:
        family_for(AutoModelForCausalLM.from_config(config))
    assert str(err.value) == message
    config.save_pretrained(tmp_path / "model")  # a config, no weights
    run = tmp_path / "run"
    proc = train_in_process(["--model", str(tmp_path / "model"), "--output-dir", str(run)])
    assert (proc.returncode, proc.stderr.strip()) == (2, f"error: {message}")
    assert not run.exists()


@pytest.mark.parametrize("cap", [0.0, float("inf")])
def test_a_gemma_logit_cap_of_zero_or_infinity_is_refused_from_its_config(tmp_path, cap):
    """A config.json setting final_logit_softcapping to 0 (meant as "no cap", which is
    null) makes every logit 0 or NaN: the job loaded the weights, then failed at its first
    evaluation blaming them. Refused from config.json alone, and as the family wraps it."""

    config = CONFIGS["gemma2"]()
    config.final_logit_softcapping = cap
    message = (
        f"this Gemma config sets final_logit_softcapping to {cap!r}, which makes every "
        "logit 0 or NaN; set it to a positive number, or to null for no cap"
    )
    refused_as_wrapped_and_from_its_config(config, message, tmp_path)
