"""A stand-in for MeZO's ``medium_models/src/modeling_roberta.py`` in the tests of
``benchmarks/peer_steps.py --mezo-medium PATH --peft lora``: a RoBERTa self-attention whose
query and value projections are LoRA layers (loralib's ``Linear``, rank and alpha from the
config), as the MeZO paper's "MeZO (LoRA)" rows take them from the LoRA paper (arXiv
2106.09685). Never imported: the check evaluates the ``lora.Linear(...)`` calls."""
# ruff: noqa: F821  (lora and nn are the names the check gives the code)


class RobertaSelfAttention:
    def __init__(self, config):
        self.all_head_size = config.hidden_size
        if getattr(config, "apply_lora", False):
            self.query = lora.Linear(
                config.hidden_size, self.all_head_size, config.lora_r, lora_alpha=config.lora_alpha
            )
        else:
            self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        if getattr(config, "apply_lora", False):
            self.value = lora.Linear(
                config.hidden_size, self.all_head_size, config.lora_r, lora_alpha=config.lora_alpha
            )
        else:
            self.value = nn.Linear(config.hidden_size, self.all_head_size)
