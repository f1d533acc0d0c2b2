"""A stand-in for MeZO's ``medium_models/src/trainer.py`` in ``benchmarks/peer_steps.py``'s
tests (``--mezo-medium``): MeZO-SGD (arXiv 2305.17333, algorithm 1: perturb by +eps z,
-2 eps z, +eps z from one seed; ``projected_grad = (L+ - L-) / 2 eps``; regenerate z for
the update, with weight decay on every tensor) in the methods and the ``train()`` branch
the real file has, so the check's reading of them is tested without the peer. Never
imported: the check compiles its methods and the ZO branch of ``train``."""
# ruff: noqa: F821  (torch and np are the names the check gives the methods)


class Trainer:
    def should_optim(self, name, param):
        return param.requires_grad

    def zo_forward(self, model, inputs):
        model.eval()
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, self._prepare_inputs(inputs))
        return loss.detach()

    def efficient_perturb_parameters(self, model, random_seed, scaling_factor=1):
        torch.manual_seed(random_seed)
        for _, param in self.named_parameters_to_optim:
            z = torch.normal(mean=0, std=1, size=param.data.size(), dtype=param.data.dtype)
            param.data = param.data + scaling_factor * z * self.args.zero_order_eps
        return model

    def get_num_samples(self):
        return 1

    def train(self):
        model = self.model
        for _ in range(int(self.args.num_train_epochs)):
            for inputs in self.get_train_dataloader():
                if self.args.zero_order_optim:
                    self.named_parameters_to_optim = [
                        (n, p) for n, p in model.named_parameters() if self.should_optim(n, p)
                    ]
                    random_seed = np.random.randint(1000000000)
                    with torch.no_grad():
                        model = self.efficient_perturb_parameters(model, random_seed)
                        loss1 = self.zo_forward(model, inputs)
                        model = self.efficient_perturb_parameters(model, random_seed, -2)
                        loss2 = self.zo_forward(model, inputs)
                    projected_grad = (loss1 - loss2) / (2 * self.args.zero_order_eps)
                    model = self.efficient_perturb_parameters(model, random_seed)
                    torch.manual_seed(random_seed)
                    lr, wd = self.args.learning_rate, self.args.weight_decay
                    for _, param in self.named_parameters_to_optim:
                        z = torch.normal(
                            mean=0, std=1, size=param.data.size(), dtype=param.data.dtype
                        )
                        param.data = param.data - lr * (projected_grad * z + wd * param.data)
                    self.state.global_step += 1
