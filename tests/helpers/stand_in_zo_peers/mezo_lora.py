"""A stand-in for MeZO's ``large_models/lora.py`` in ``benchmarks/peer_steps.py --peft lora``'s
tests: LoRA as the LoRA paper (arXiv 2106.09685) and MeZO's README describe it (``q_proj``
and ``v_proj`` of every OPT attention, ``W x + (alpha / r) B A x``, ``A`` Kaiming-uniform,
``B`` zero, only ``A`` and ``B`` trained), under the names run.py calls. Never imported:
the script compiles its definitions."""
# ruff: noqa: F821  (torch, nn, math are the names the script gives the definitions)


def find_module(root, key):
    *path, name = key.split(".")
    parent = root
    for part in path:
        parent = getattr(parent, part)
    return parent, name, getattr(parent, name)


class LoRALinear(nn.Linear):  # type: ignore[name-defined]
    def __init__(self, in_features, out_features, r=0, lora_alpha=1, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.lora_A = nn.Parameter(torch.empty(r, in_features))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r))
        self.scaling = lora_alpha / r

    def forward(self, x):
        return super().forward(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling


class LoRA:
    def __init__(self, model, r, alpha, float16):
        for key, _ in list(model.named_modules()):
            if not key.endswith("attn"):
                continue
            _, _, attention = find_module(model, key)
            for name in ("q_proj", "v_proj"):
                old = getattr(attention, name)
                new = LoRALinear(old.in_features, old.out_features, r=r, lora_alpha=alpha)
                new.weight, new.bias = old.weight, old.bias
                setattr(attention, name, new)
        for name, param in model.named_parameters():
            param.requires_grad = "lora" in name
