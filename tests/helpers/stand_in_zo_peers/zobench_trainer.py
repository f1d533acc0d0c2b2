"""A stand-in for ZO-Bench's ``zo-bench/trainer.py`` in ``benchmarks/peer_steps.py``'s
tests: ZO-SGD with momentum and ZO-Adam as the paper states them (arXiv 2402.11592, the
randomized gradient estimate handed to a first-order optimizer), with torch's ``SGD`` and
``Adam`` as that optimizer, in the methods and attributes the real file has, so that the
script's reading and running of ZO-Bench is tested without it. Never imported: the script
compiles its methods and its optimizer set-up."""
# ruff: noqa: F821  (torch, np, SGD and Adam are the names the script gives the methods)


class OurTrainer:
    def _inner_training_loop(self, args):
        # the one statement the script runs: which optimizer takes the estimate
        if args.trainer == "zo_adam":
            self.optimizer = Adam(self.model.parameters(), lr=args.learning_rate)
        elif args.trainer == "zo_sgd":
            self.optimizer = SGD(
                self.model.parameters(), lr=args.learning_rate, momentum=args.momentum
            )

    def get_grad_sparsity_by_name(self, name):
        return self.gradient_sparsity

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
        self.args.q = 1
        return self.zo_step_v1(model, inputs)

    def zo_step_v1(self, model, inputs):
        """q directions, each a fresh seed, L+ and L- and the weights restored; their mean
        g z is the gradient the optimizer takes, in one step. Returns the last L+."""
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.named_parameters_to_optim = params
        self.optimizer.zero_grad()
        for query in range(self.args.q):
            self.zo_random_seed = np.random.randint(1000000000)
            self.zo_perturb_parameters(scaling_factor=1)
            plus = self.zo_forward(model, inputs)
            self.zo_perturb_parameters(scaling_factor=-2)
            minus = self.zo_forward(model, inputs)
            self.zo_perturb_parameters(scaling_factor=1)
            self.projected_grad = ((plus - minus) / (2 * self.args.zo_eps)).item()
            torch.manual_seed(self.zo_random_seed)
            for _, param in params:
                z = torch.normal(mean=0, std=1, size=param.data.size(), dtype=param.data.dtype)
                share = self.projected_grad * z / self.args.q
                param.grad = share if query == 0 else param.grad + share
        self.optimizer.step()
        return plus

    def zo_update(self, model):
        self.lr_scheduler.step()
