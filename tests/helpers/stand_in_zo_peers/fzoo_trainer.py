"""A stand-in for FZOO's ``trainer.py`` in ``benchmarks/peer_steps.py``'s tests: FZOO's
step written from the paper (arXiv 2506.09034: N one-sided Rademacher directions, the
differences to L(theta) over N times the losses' population std) in the methods and
attributes the real file has. Never imported: the script compiles its methods."""
# ruff: noqa: F821  (torch and np are the names the script gives the methods)


class ZOTrainer:
    def zo_perturb_parameters(self, random_seed=None, scaling_factor=1):
        torch.manual_seed(random_seed if random_seed is not None else self.zo_random_seed)
        for _, param in self.named_parameters_to_optim:
            signs = torch.randint(0, 2, size=param.data.size(), dtype=param.data.dtype)
            param.data = param.data + scaling_factor * self.args.zo_eps * (2 * signs - 1)

    def zo_forward(self, model, inputs):
        model.eval()
        with torch.inference_mode():
            return self.compute_loss(model, self._prepare_inputs(inputs)).detach()

    def zo_step(self, model, inputs):
        self.named_parameters_to_optim = [
            (n, p) for n, p in model.named_parameters() if p.requires_grad
        ]
        self.zo_random_seeds, perturbed = [], []
        for _ in range(self.N):
            self.zo_random_seed = np.random.randint(1000000000)
            self.zo_random_seeds.append(self.zo_random_seed)
            self.zo_perturb_parameters(scaling_factor=1)
            perturbed.append(self.zo_forward(model, inputs).item())
            self.zo_perturb_parameters(scaling_factor=-1)
        losses = torch.tensor(perturbed, dtype=torch.float32)
        at_theta = self.zo_forward(model, inputs)
        spread = losses.std(unbiased=False)
        self.projected_grad = (losses - at_theta) / (self.N * spread)
        return at_theta

    def zo_update(self, model):
        lr = self._get_learning_rate()
        for seed, g in zip(self.zo_random_seeds, self.projected_grad):
            torch.manual_seed(seed)
            for _, param in self.named_parameters_to_optim:
                signs = torch.randint(0, 2, size=param.data.size(), dtype=param.data.dtype)
                param.data = param.data - lr * g * (2 * signs - 1)
        self.lr_scheduler.step()
