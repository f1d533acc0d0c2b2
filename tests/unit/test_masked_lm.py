"""Encoders as masked LMs (RoBERTa, XLM-RoBERTa): loaded as ``...ForMaskedLM``, a candidate
scored by the logits at its ``<mask>`` (MeZO's and LOZO's prompt fine-tuning), trained
offloaded as resident, exported for transformers and peft, and refused in one line where
a next token is needed."""

import warnings

import pytest
import torch
from transformers import AutoModelForMaskedLM

from distzo import ZOConfig, ZOEngine
from distzo.adapters.peft_adapters import AdapterSpec, attach_adapter
from distzo.engine.passes import UNPERTURBED
from distzo.export.hf_model import export_model
from distzo.models.config_file import model_size
from distzo.models.registry import family_for
from distzo.models.weights import skeleton
from distzo.objectives import ChoiceEncoding, Classification, LanguageModeling, collate_choices
from tests.helpers.models import CONFIGS, build, random_batch

MASK, GREAT, TERRIBLE = 4, 10, 20  # a <mask> token and two label words of the tiny vocabulary


def mask_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Three examples, one row each (a prompt with one <mask>, right-padded), both label
    words scored at the mask's own position, as MeZO's RoBERTa prompts are."""
    g = torch.Generator().manual_seed(seed)
    encodings = []
    for e, (length, at) in enumerate([(9, 6), (6, 2), (8, 7)]):
        ids = torch.randint(5, 64, (length,), generator=g).tolist()
        ids[at] = MASK
        scored = ((0, at, GREAT, 0), (0, at, TERRIBLE, 1))
        encodings.append(ChoiceEncoding((tuple(ids),), scored, label=e % 2))
    return collate_choices(encodings, pad_id=0)


def engine_of(model, **options) -> ZOEngine:
    config = dict(lr=1e-3, eps=1e-3, seed=4, device="cpu", noise_chunk=300, weight_decay=0.1)
    return ZOEngine(model, ZOConfig(**{**config, **options}), objective=Classification())


@pytest.mark.parametrize("name", ["roberta", "xlm_roberta"])
def test_a_candidate_is_scored_by_the_logits_at_its_mask(name):
    """The classification loss is MeZO's: cross-entropy over the label words' logits at
    the <mask> position of the model's own forward (no shift to the position before)."""
    model = build(name, seed=1, dtype=torch.float64)
    batch = mask_batch()
    rows = batch["input_ids"][:, 0]
    with torch.no_grad():  # before the engine takes the model's parameters over
        logits = model(input_ids=rows, attention_mask=batch["attention_mask"][:, 0]).logits
    engine = engine_of(model)
    objective = Classification()
    prepared = objective.prepare(batch, engine.device)
    loss = engine.evaluate(lambda runner: objective.losses(runner, prepared, (UNPERTURBED,), 3))
    at = batch["score_position"][:, 0]  # flat r * L + t, one row: the mask's position
    words = logits[torch.arange(3), at][:, [GREAT, TERRIBLE]]
    expected = torch.nn.functional.cross_entropy(words, batch["label"])
    assert loss[UNPERTURBED].item() == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.parametrize("method", [None, "lora-fa"])
def test_offload_trajectory_equals_resident(method):
    runs = {}
    for mode in ("offload", "resident"):
        model = build("roberta", dtype=torch.float64)
        if method is not None:
            model = attach_adapter(model, AdapterSpec(method, r=4, alpha=8), seed=5)
        engine = engine_of(model, mode=mode)
        results = [engine.step(mask_batch(seed=i)) for i in range(4)]
        runs[mode] = ([r.projected_grad for r in results], engine.named_parameters())
    assert runs["offload"][0] == runs["resident"][0]
    assert len(set(runs["offload"][0])) == 4  # the steps moved the model
    for key, value in runs["resident"][1].items():
        assert torch.equal(runs["offload"][1][key], value), key


def test_the_head_is_tied_to_the_word_embeddings():
    params = engine_of(build("roberta")).named_parameters()
    tied = params["lm_head.decoder.weight"]
    assert tied is params["roberta.embeddings.word_embeddings.weight"]
    assert params["lm_head.decoder.bias"] is params["lm_head.bias"]


def test_the_loaders_build_the_masked_lm():
    """A config of an encoder is built as its masked LM by every loader: the model, the
    meta skeleton a checkpoint fills, and the size count the memory plan reads."""
    config = CONFIGS["roberta"]()
    model = skeleton(config, torch.float32)
    assert type(model).__name__ == "RobertaForMaskedLM"
    built = sum(p.numel() for p in build("roberta").parameters())
    assert model_size(config, "--model x").parameters == built


def test_a_full_export_loads_back_as_a_masked_lm_with_the_engines_logits(tmp_path):
    engine = engine_of(build("roberta", dtype=torch.float64), mode="offload")
    for i in range(2):
        engine.step(mask_batch(seed=i))
    batch = random_batch(64, pad="right", seed=9)
    logits, _ = engine.forward(batch)
    export_model(engine, tmp_path / "export")
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path / "export").eval()
    assert type(loaded).__name__ == "RobertaForMaskedLM"
    with torch.no_grad():
        theirs = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert torch.equal(theirs.logits, logits)


def test_a_lora_adapter_loads_with_peft_onto_the_masked_lm(tmp_path):
    from peft import PeftModel

    build("roberta", dtype=torch.float64).save_pretrained(tmp_path / "base")
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "base", dtype=torch.float64)
    engine = engine_of(attach_adapter(model, AdapterSpec("lora", r=4, alpha=8), seed=5))
    for i in range(2):
        engine.step(mask_batch(seed=i))
    batch = random_batch(64, pad="right", seed=9)
    logits, _ = engine.forward(batch)
    export_model(engine, tmp_path / "adapter")
    base = AutoModelForMaskedLM.from_pretrained(tmp_path / "base", dtype=torch.float64)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert torch.allclose(theirs.logits, logits, rtol=0, atol=1e-12)
    # peft's own RoBERTa targets; no task type (peft has no masked-LM one)
    config = loaded.peft_config["default"]
    assert (set(config.target_modules), config.task_type) == ({"query", "value"}, None)
    with torch.no_grad():  # the adapter trained: without it the logits are others
        with loaded.disable_adapter():
            plain = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert not torch.allclose(plain.logits, logits, rtol=0, atol=1e-9)


def test_a_lora_target_that_is_not_linear_is_refused_naming_robertas_own_targets():
    """The example of linear targets is the model's own (peft's RoBERTa targets), not
    OPT's and Llama's q_proj,v_proj, which a RoBERTa has no module of."""
    with pytest.raises(ValueError) as err:
        attach_adapter(build("roberta"), AdapterSpec("lora", targets=("word_embeddings",)), 0)
    assert str(err.value) == (
        "--lora-targets: roberta.embeddings.word_embeddings (Embedding) is not a linear "
        "layer; --peft lora trains LoRA on linear layers only (such as query,value)"
    )


NO_NEXT_TOKEN = (
    "reads a causal LM's next token, and model type 'roberta' is a masked LM; give "
    "objective=Classification() or Accuracy() on choice batches whose score_position is "
    "each candidate's <mask> position"
)


def test_an_objective_reading_a_next_token_is_refused_naming_the_fix():
    with pytest.raises(ValueError) as err:
        ZOEngine(build("roberta"), ZOConfig(device="cpu"))
    assert str(err.value) == f"objective LanguageModeling (the default objective) {NO_NEXT_TOKEN}"
    with pytest.raises(ValueError) as err:
        ZOEngine(build("roberta"), ZOConfig(device="cpu"), objective=LanguageModeling())
    assert str(err.value) == f"objective LanguageModeling {NO_NEXT_TOKEN}"


@pytest.mark.parametrize("name, pad", [("roberta", "left"), ("xlm_roberta", "right")])
def test_the_blockwise_forward_with_a_prefix_is_pefts_own_on_an_encoder(name, pad):
    """peft's prefix on an encoder: the layers take it as a cache, the padding mask is
    widened by it and the positions count from after it; distzo's blocks, each with its
    own prefix, give peft's logits bit for bit."""
    spec = AdapterSpec("prefix", prefix_length=3, prefix_init="random")
    model = attach_adapter(build(name), spec, seed=5).eval()
    assert type(model).__name__ == "PeftModelForFeatureExtraction"
    batch = random_batch(64, pad=pad, seed=1)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad(), warnings.catch_warnings():
        theirs = model(input_ids=ids, attention_mask=mask).logits
        plain = model.get_base_model()(input_ids=ids, attention_mask=mask).logits
        warnings.simplefilter("error", FutureWarning)  # the prefix's cache: no deprecated keyword
        ours, _ = family_for(model.get_base_model()).forward(ids, mask)
    assert torch.equal(ours, theirs)
    assert not torch.allclose(plain, theirs, atol=1e-2)  # the prefix does change the function


def test_a_prefixed_encoder_trains_offloaded_as_resident_and_loads_with_peft(tmp_path):
    from peft import PeftModel

    runs = {}
    for mode in ("offload", "resident"):
        spec = AdapterSpec("prefix", prefix_length=2)  # MeZO's init: real activations
        model = attach_adapter(build("roberta", dtype=torch.float64), spec, seed=5)
        engine = engine_of(model, mode=mode)
        results = [engine.step(mask_batch(seed=i)) for i in range(3)]
        runs[mode] = ([r.projected_grad for r in results], engine.named_parameters())
    assert runs["offload"][0] == runs["resident"][0] and len(set(runs["offload"][0])) == 3
    assert all(n.endswith(".prefix_tuning.key_values") for n in runs["resident"][1])
    for key, value in runs["resident"][1].items():
        assert torch.equal(runs["offload"][1][key], value), key
    batch = random_batch(64, pad="right", seed=9)
    logits, _ = engine.forward(batch)
    export_model(engine, tmp_path / "adapter")
    base = build("roberta", dtype=torch.float64)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert loaded.peft_config["default"].peft_type == "PREFIX_TUNING"
    with torch.no_grad():
        theirs = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    # the export writes the prefix into peft's own table, float32 (as peft builds it)
    assert torch.allclose(theirs.logits, logits, rtol=0, atol=1e-9)
    with torch.no_grad():  # the prefix trained: the base alone gives other logits
        plain = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert not torch.allclose(plain.logits, logits, rtol=0, atol=1e-3)


def test_the_real_prefix_init_is_each_layers_keys_and_values_of_random_tokens():
    """MeZO's init on RoBERTa (its prefix.py): each layer's keys and values of random
    tokens run through the encoder alone, positions from the start, no prefix before."""
    model = attach_adapter(build("roberta"), AdapterSpec("prefix", prefix_length=4), seed=5)
    base = model.get_base_model()
    tokens = base.roberta.encoder.layer[0].prefix_tuning.init_tokens
    engine = engine_of(model, mode="offload")
    projected = {}
    reference = build("roberta")
    for i, layer in enumerate(reference.roberta.encoder.layer):
        for kind in ("key", "value"):
            getattr(layer.attention.self, kind).register_forward_hook(
                lambda module, args, out, at=(i, kind): projected.__setitem__(at, out[0])
            )
    with torch.no_grad():
        reference.roberta(input_ids=tokens)
    values = engine.named_parameters()
    for i in range(len(reference.roberta.encoder.layer)):
        kv = values[f"roberta.encoder.layer.{i}.prefix_tuning.key_values"]  # (4, 2, heads, dim)
        assert torch.allclose(kv[:, 0].flatten(1), projected[i, "key"], atol=1e-6)
        assert torch.allclose(kv[:, 1].flatten(1), projected[i, "value"], atol=1e-6)


@pytest.mark.parametrize("prefix", [0, 3])
def test_positions_count_from_after_the_pad_id_and_the_longest_sequence_runs(prefix):
    """RoBERTa's positions start at pad id + 1 (its 514 rows hold 512 tokens): a sequence
    one token longer than what is left is refused in one line, not an index error in the
    embeddings; the job's tokenizer truncates to the same count."""
    from distzo.config.job import JobConfig
    from distzo.job.build import token_positions

    model = build("roberta")  # 40 positions, pad id 0: 39 tokens, less a prefix
    if prefix:
        model = attach_adapter(model, AdapterSpec("prefix", prefix_length=prefix), seed=5)
    engine = engine_of(model)
    longest = 39 - prefix
    for length in (longest, longest + 1):
        ids = torch.randint(5, 64, (2, length), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if length == longest:
            engine.forward(batch)
            continue
        with pytest.raises(ValueError) as err:
            engine.forward(batch)
    after = f" after a {prefix}-token prefix" if prefix else ""
    assert str(err.value) == (
        f"sequences of {longest + 1} tokens{after} exceed the model's max_position_embeddings "
        "40 less the 1 it keeps before a first token; truncate them"
    )
    job = JobConfig()
    job.peft.peft, job.peft.prefix_length = ("prefix", prefix) if prefix else ("none", 5)
    assert token_positions(job, CONFIGS["roberta"]()) == longest


def test_labels_of_another_shape_are_refused_without_saying_a_masked_lm_shifts_them():
    """The hint said labels are the ids themselves 'which the model shifts': a masked LM
    reads each label at its own position, so a user of one was told the wrong thing."""
    engine = engine_of(build("roberta"))
    rows = torch.randint(5, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as err:
        engine.forward({"input_ids": rows, "labels": rows[:, 1:]})
    assert str(err.value) == (
        "labels must have input_ids' shape (2, 7), got (2, 6); labels are token ids at "
        "input_ids' own positions (-100 where no loss is taken): a causal LM's loss shifts "
        "them itself, a masked LM's reads each where it stands"
    )


def test_a_decoder_config_is_refused():
    from distzo.models.registry import check_supported

    config = CONFIGS["roberta"]()
    config.is_decoder = True
    with pytest.raises(ValueError) as err:
        check_supported(config.model_type).check_config(config)
    assert str(err.value) == (
        "this roberta config sets is_decoder (a causal decoder, not the masked LM distzo "
        "loads it as); set is_decoder to false in its config.json"
    )


def test_the_job_refuses_a_masked_lm_from_its_config_before_any_run_directory(tmp_path):
    from tests.helpers.launch import train_in_process

    CONFIGS["roberta"]().save_pretrained(tmp_path / "model")  # a config, no weights
    run = tmp_path / "run"
    proc = train_in_process(
        ["--model", str(tmp_path / "model"), "--task", "text", "--output-dir", str(run)]
    )
    assert (proc.returncode, proc.stderr.strip()) == (
        2,
        "error: --task text needs a causal LM, and model type 'roberta' is a masked LM (its "
        "head predicts the token under a <mask>, no next token); train it on one of MeZO's "
        "RoBERTa tasks (sst2, sst5, mr, cr, mpqa, subj, cola, trec, qqp, mrpc, qnli, rte, "
        "mnli, snli) with --objective classification (their default) or accuracy",
    )
    assert not run.exists()


def test_the_exported_training_step_refuses_a_masked_lm(tmp_path):
    from distzo.export.training_step import _lora_fa_engine, _parser

    CONFIGS["roberta"]().save_pretrained(tmp_path / "model")  # a config, no weights
    args = _parser().parse_args(["--model", str(tmp_path / "model"), "--out", str(tmp_path)])
    with pytest.raises(ValueError) as err:
        _lora_fa_engine(args)
    assert str(err.value).startswith(
        "the exported training step (its loss is next-token cross-entropy) needs a causal LM"
    )


def test_the_masked_lm_loss_is_the_models_own_in_float32_and_sums_over_num_items():
    """ZOEngine.forward's loss of a masked LM: the model's own masked-LM cross-entropy of
    each labelled position's logits (no shift), upcast from bfloat16 logits, and the
    family contract's summed form divided by ``num_items``."""
    from distzo.models.registry import family_for

    model = build("roberta", seed=1)
    rows = torch.randint(5, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(rows, -100)
    labels[0, 3], labels[1, 5] = GREAT, TERRIBLE
    with torch.no_grad():
        out = model(input_ids=rows, labels=labels)
    family = family_for(model)
    assert family.loss(out.logits, labels, None).item() == pytest.approx(out.loss.item())
    assert family.loss(out.logits, labels, 4).item() == pytest.approx(out.loss.item() * 2 / 4)
    low = out.logits.to(torch.bfloat16)
    upcast = torch.nn.functional.cross_entropy(
        low.float().reshape(-1, low.shape[-1]), labels.reshape(-1)
    )
    loss = family.loss(low, labels, None)
    assert loss.dtype == torch.float32 and loss.item() == upcast.item()
