"""A stand-in for MeZO's ``medium_models/run.py`` in the tests of ``benchmarks/peer_steps.py
--mezo-medium PATH --peft lora``: under ``--apply_lora`` the encoder's own weights are
frozen and everything else trains (the adapters, and the prompt model's head, whose names
do not start with the encoder's). Never imported: the check compiles the body of the
``if model_args.apply_lora:`` that freezes."""


def main(model, model_args):
    if model_args.apply_lora:
        for name, param in model.named_parameters():
            if name.startswith("roberta") and "lora" not in name:
                param.requires_grad_(False)
