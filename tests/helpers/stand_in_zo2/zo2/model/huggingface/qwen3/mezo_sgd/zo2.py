"""Stand-in for ZO2's Qwen3 offload model code (see ../../../../../README.md): the units
its training forwards hand the offload's dual forward, in order (the embeddings, the
rotary embedding, each decoder layer, the final norm; then the head, a unit of its own
even when tied to the embeddings), none with a weight decay of its own (ZO2's rule by
name applies). The check reads these calls; it never runs this file."""
# ruff: noqa: F821
# mypy: ignore-errors


class OptimizerQwen3Model(MeZO2SGD):
    def inner_zo_forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        embeds = self.task_compute_module(
            self.model.embed_tokens,
            {"input": input_ids},
            {"input": input_ids},
            grad=self.projected_grad,
        )
        rotary = self.task_compute_module(
            self.model.rotary_emb,
            {"x": embeds[0], "position_ids": position_ids},
            {"x": embeds[1], "position_ids": position_ids},
            grad=self.projected_grad,
        )
        hidden = embeds
        for i in range(1, self.model.config.num_hidden_layers):
            hidden = self.task_compute_module(
                self.model.layers[i - 1],
                hidden_inputs(hidden, rotary, 0),
                hidden_inputs(hidden, rotary, 1),
                grad=self.projected_grad,
            )
        hidden = self.task_compute_module(
            self.model.layers[-1],
            hidden_inputs(hidden, rotary, 0),
            hidden_inputs(hidden, rotary, 1),
            grad=self.projected_grad,
        )
        return self.task_compute_module(
            module=self.model.norm,
            inputs1={"hidden_states": hidden[0]},
            inputs2={"hidden_states": hidden[1]},
            grad=self.projected_grad,
        )


class OptimizerQwen3ForCausalLM(MeZO2SGD):
    def inner_zo_forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        hidden = self.model.model(input_ids=input_ids, attention_mask=attention_mask)
        logits = self.task_compute_module(
            self.model.lm_head,
            {"input": hidden[0]},
            {"input": hidden[1]},
            grad=self.projected_grad,
        )
        return tuple(self.model.loss_function(logits=x, labels=labels) for x in logits)
