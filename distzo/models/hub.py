"""A hub model as a local directory, so that it streams like one (never loaded whole).

``from_pretrained`` would build the whole model in every rank's memory before the
engine copied it into its buckets (8 ranks x 26 GB for OPT-13B). Instead the
repository's files are downloaded once per node into the Hugging Face cache
(``huggingface_hub.snapshot_download``), and the engine reads the snapshot bucket by
bucket, exactly as for a local directory. Only what loading needs is fetched: the
configs, the tokenizer, and the weights in safetensors when the repository has them
(else its PyTorch ``.bin`` files, read with ``weights_only=True``); never code.
"""

from __future__ import annotations

from pathlib import Path

METADATA = [
    "*.json",
    "*.txt",
    "*.model",
    "*.jinja",
    "*.tiktoken",
]  # configs, tokenizers, chat templates


def weight_patterns(files: list[str]) -> list[str]:
    """The files to fetch from a repository listing ``files``: safetensors if it has any."""
    if any(f.endswith(".safetensors") for f in files):
        return METADATA + ["*.safetensors"]
    return METADATA + ["*.bin"]


def snapshot(name: str, download: bool, revision: str | None = None) -> Path:
    """The local directory of hub model ``name``. ``download``: fetch what is missing (one
    rank per node); otherwise the cached snapshot that rank made (the node's other ranks,
    after it), with no network access."""
    from huggingface_hub import list_repo_files, snapshot_download

    try:
        if not download:
            return Path(snapshot_download(name, revision=revision, local_files_only=True))
        try:
            patterns = weight_patterns(list_repo_files(name, revision=revision))
        except Exception:  # offline (HF_HUB_OFFLINE) or no listing: take what the cache holds
            patterns = None
        return Path(snapshot_download(name, revision=revision, allow_patterns=patterns))
    except Exception as err:  # network, authentication, a name that is not a repository
        raise ValueError(f"cannot download --model {name!r}: {str(err).splitlines()[0]}") from None
