import pytest
import torch

from distzo.models import model_from_config
from distzo.models.tiny import tiny_opt_config

# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine two
# threads per process thrash (measured 40x slower); one keeps the suite fast and steady.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def tiny_opt(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random-init OPT, the same weights for the same seed."""
    torch.manual_seed(seed)
    return model_from_config(tiny_opt_config(**overrides), dtype=dtype)


def random_batch(vocab_size: int, batch: int = 4, seq: int = 12, seed: int = 0, pad: str | None = None):
    """Token ids (avoiding the pad id 0) with an attention mask; ``pad`` left/right pads some rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    if pad is not None:
        for row, n in enumerate([0, 3, 5, 1][:batch]):
            if n:
                if pad == "left":
                    mask[row, :n] = 0
                else:
                    mask[row, seq - n :] = 0
        ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
