"""Stand-in for ZO2's MeZO-SGD (see ../../../README.md): MeZO's step (arXiv 2305.17333,
algorithm 1), the update applied at once, weight decay spared by name."""
# ruff: noqa: F821
# mypy: ignore-errors


class MeZOSGD(BaseOptimizer):
    def __init__(self, model, config):
        self.config, self.model = config, model
        self.lr, self.weight_decay, self.zo_eps = config.lr, config.weight_decay, config.eps
        self.max_zo_random_seed = config.max_zo_random_seed
        super().__init__(model.parameters(), dict(lr=config.lr, weight_decay=config.weight_decay))

    def zo_perturb_parameters(self, module, scaling_factor=1):
        for param in module.parameters():
            if param.requires_grad:
                z = torch.normal(mean=0, std=1, size=param.size(), dtype=param.dtype)
                param.data.add_(z, alpha=scaling_factor * self.zo_eps)

    def zo_update(self, module, weight_decay=None):
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            z = torch.normal(mean=0, std=1, size=param.size(), dtype=param.dtype)
            if weight_decay is None:
                decay = (
                    0.0
                    if any(s in name for s in ("bias", "layer_norm", "layernorm", "ln"))
                    else self.weight_decay
                )
            else:
                decay = weight_decay
            param.data.sub_(self.lr * (self.projected_grad * z + decay * param.data))

    def zo_perturb_shifts(self):
        return [1, -2, 1]

    def compute_grad(self, loss1, loss2):
        return float((loss1 - loss2) / (2 * self.zo_eps))

    @torch.inference_mode()
    def zo_forward(self, *args, **kwargs):
        self._update_lr()
        seed = np.random.randint(self.max_zo_random_seed)
        losses = []
        for shift in self.zo_perturb_shifts()[:2]:
            torch.manual_seed(seed)
            self.zo_perturb_parameters(self.model, scaling_factor=shift)
            losses.append(self.inner_zo_forward(*args, **kwargs))
        self.projected_grad = self.compute_grad(*losses)
        torch.manual_seed(seed)
        self.zo_perturb_parameters(self.model, scaling_factor=self.zo_perturb_shifts()[2])
        torch.manual_seed(seed)
        self.zo_update(self.model)
        return losses[0]
