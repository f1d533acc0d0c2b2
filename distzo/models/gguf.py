"""A GGUF file (llama.cpp's format) as a Hugging Face directory that ``--model`` streams.

transformers reads GGUF (dequantising to float) but ``save_pretrained`` refuses a model
loaded from one, so the weights are written with safetensors directly, beside the
config and the tokenizer. Needs the ``gguf`` package (the ``test`` extra has it).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from distzo.runtime.folders import nearest_existing, unwritable


def gguf_to_hf(
    gguf_file: str | Path, directory: str | Path, dtype: torch.dtype = torch.float32
) -> Path:
    """Write ``gguf_file`` as ``directory`` (config, one safetensors file, tokenizer); a
    directory already holding the conversion is reused. Written to a temporary folder
    first and renamed, so an interrupted conversion leaves nothing half-written."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distzo.runtime.safetensors_write import ordinary_mode, safetensors_write

    gguf_file, directory = Path(gguf_file), Path(directory)
    if (directory / "model.safetensors").is_file():
        return directory
    if not gguf_file.is_file():
        raise ValueError(f"{gguf_file}: no such GGUF file")
    existing = nearest_existing(directory.parent.absolute())
    why = unwritable(existing) if existing.is_dir() else "a file, not a directory"
    if why is not None:  # known now, not after a read of the whole file
        raise ValueError(
            f"{directory}: {existing} cannot hold it ({why}); give a directory this user may write"
        )
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    # mkdtemp makes it private; the result is an ordinary directory
    staging.chmod(ordinary_mode(directory=True))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=dtype
        )
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # stored once, as the model's own save would
        weights = staging / "model.safetensors"
        with safetensors_write(weights):  # a full disk is an OSError, as for any file
            save_file(state, str(weights), metadata={"format": "pt"})
        if getattr(model.config, "quantization_config", None) is not None:
            # the weights written are plain floats, not GGUF blocks
            del model.config.quantization_config
        model.config.save_pretrained(staging)
        AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(
            staging
        )
        staging.replace(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory
