"""A stand-in for MeZO's ``large_models/trainer.py`` in ``benchmarks/peer_steps.py``'s
tests: the MeZO-SGD step written from the paper (arXiv 2305.17333, algorithm 1) in the
methods and attributes the real file has, so the script's reading and running of a peer
is tested without the peer. Never imported: the script compiles its methods."""
# ruff: noqa: F821  (torch and np are the names the script gives the methods)


class ZOTrainer:
    def zo_perturb_parameters(self, random_seed=None, scaling_factor=1):
        torch.manual_seed(random_seed if random_seed is not None else self.zo_random_seed)
        for _, param in self.named_parameters_to_optim:
            z = torch.normal(mean=0, std=1, size=param.data.size(), dtype=param.data.dtype)
            param.data = param.data + scaling_factor * self.args.zo_eps * z

    def zo_forward(self, model, inputs):
        model.eval()
        with torch.inference_mode():
            return self.compute_loss(model, self._prepare_inputs(inputs)).detach()

    def zo_step(self, model, inputs):
        self.named_parameters_to_optim = [
            (n, p) for n, p in model.named_parameters() if p.requires_grad
        ]
        self.zo_random_seed = np.random.randint(1000000000)
        self.zo_perturb_parameters(scaling_factor=1)
        plus = self.zo_forward(model, inputs)
        self.zo_perturb_parameters(scaling_factor=-2)
        minus = self.zo_forward(model, inputs)
        self.zo_perturb_parameters(scaling_factor=1)
        self.projected_grad = ((plus - minus) / (2 * self.args.zo_eps)).item()
        return plus

    def zo_update(self, model):
        torch.manual_seed(self.zo_random_seed)
        lr, wd = self._get_learning_rate(), self.args.weight_decay
        for _, param in self.named_parameters_to_optim:
            z = torch.normal(mean=0, std=1, size=param.data.size(), dtype=param.data.dtype)
            decay = wd * param.data if param.data.dim() >= 2 else 0.0
            param.data = param.data - lr * (self.projected_grad * z + decay)
        self.lr_scheduler.step()
