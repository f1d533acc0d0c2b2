"""A stand-in for MeZO's ``medium_models/src/models.py`` in ``benchmarks/peer_steps.py``'s
tests (``--mezo-medium``): prompt-based fine-tuning as the MeZO paper takes it from LM-BFF
(arXiv 2012.15723): the masked LM's scores at the ``<mask>`` position, the label words'
columns as the classes' logits, cross-entropy against the label's index. Never imported:
the check compiles ``model_for_prompting_forward`` and the class's methods."""
# ruff: noqa: F821  (torch and nn are the names the check gives the code)


def model_for_prompting_forward(
    model, input_ids=None, attention_mask=None, token_type_ids=None, mask_pos=None, labels=None
):
    hidden = model.get_model_fn()(input_ids, attention_mask=attention_mask)[0]
    at_mask = hidden[torch.arange(hidden.size(0)), mask_pos.squeeze()]
    scores = model.get_lm_head_fn()(at_mask)
    logits = scores[:, model.label_word_list]
    loss = nn.CrossEntropyLoss()(logits, labels.view(-1)) if labels is not None else None
    return (logits,) if loss is None else (loss, logits)


class RobertaModelForPromptFinetuning:
    def __init__(self, config):
        raise NotImplementedError("the check stands this in")

    def tie_emb(self):
        self._tie_or_clone_weights(self.lm_head.decoder, self.roberta.get_input_embeddings())

    def get_model_fn(self):
        return self.roberta

    def get_lm_head_fn(self):
        return self.lm_head

    def forward(
        self, input_ids=None, attention_mask=None, token_type_ids=None, mask_pos=None, labels=None
    ):
        return model_for_prompting_forward(
            self, input_ids, attention_mask, token_type_ids, mask_pos, labels
        )
