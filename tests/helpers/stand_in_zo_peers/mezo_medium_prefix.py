"""A stand-in for MeZO's ``medium_models/src/prefix.py`` in the tests of
``benchmarks/peer_steps.py --mezo-medium PATH --peft prefix``: prefix tuning as MeZO's paper
(arXiv 2305.17333, appendix) describes its RoBERTa runs (5 tokens' keys and values in every
attention, no reparameterisation, initialised with the keys and values the encoder computes
for random tokens; every token attends to all of them), under the names run.py calls,
against transformers 4.28's RoBERTa (the layer hands its attention the 4-D additive mask as
a positional argument; ``past_key_value`` a tuple; the encoder's ``use_cache=True`` returns
each layer's keys and values). Never imported: the check compiles its definitions."""
# ruff: noqa: F821  (torch and nn are the names the check gives the definitions)


def find_module(root, key):
    *path, name = key.split(".")
    parent = root
    for part in path:
        parent = getattr(parent, part)
    return parent, name, getattr(parent, name)


def attn_forward_hook(self, *args, **kwargs):
    hidden, mask, *rest = args
    rows = hidden.shape[0]

    def per_head(x):  # (tokens, hidden) -> (rows, heads, tokens, head_dim)
        return x.view(len(x), self.num_heads, -1).transpose(0, 1).expand(rows, -1, -1, -1)

    kwargs["past_key_value"] = (per_head(self.prefix_keys), per_head(self.prefix_values))
    attend = torch.zeros(*mask.shape[:-1], self.num_prefix, dtype=mask.dtype)
    return self.original_forward(hidden, torch.cat([attend, mask], dim=-1), *rest, **kwargs)


class PrefixTuning:
    def __init__(self, model, num_prefix, reparam=True, float16=False, init_by_real_act=False):
        model = model.cuda()
        size = (1, num_prefix)
        tokens = torch.randint(low=0, high=model.config.vocab_size, size=size).cuda()
        with torch.no_grad():
            real = model.roberta(input_ids=tokens, use_cache=True).past_key_values
        for key, _ in list(model.named_modules()):
            if not key.endswith("attention"):
                continue
            _, _, attention = find_module(model, key)
            layer = int(key.split("layer.")[1].split(".")[0])
            attention.original_forward = attention.forward
            attention.forward = attn_forward_hook.__get__(attention, type(attention))
            attention.num_heads = model.config.num_attention_heads
            attention.num_prefix = num_prefix
            own = [real[layer][i][0].transpose(0, 1) for i in (0, 1)]  # (tokens, heads, dim)
            keys, values = (kv.reshape(num_prefix, -1) for kv in own)
            attention.prefix_keys = nn.Parameter(keys.clone().to(model.dtype))
            attention.prefix_values = nn.Parameter(values.clone().to(model.device))
        for name, param in model.named_parameters():
            param.requires_grad = "prefix" in name
