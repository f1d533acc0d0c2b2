"""The dtypes a model's masters are held in, by the names ``--dtype`` takes: what a run
builds its model in and what a replay rebuilds it in from the seed log's header (one table,
so the two always agree), read by the job's options (which answer ``--help`` before
transformers is imported) and by ``load_model`` / ``model_from_config`` alike."""

from __future__ import annotations

import torch

# float32 by default; float64 for exact checks.
MASTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
