"""A stand-in for LOZO's trainer file, read by benchmarks/peer_lozo.py in the tests.

Written for the tests from the paper's Algorithm 1 (not from LOZO's code): the methods
carry the names and arguments benchmarks/peer_lozo.py parses out of the real file, and
draw from ``torch`` and ``np`` as it does. One choice differs from LOZO's code on purpose:
the update rewinds the generator and draws V again on a step that redraws it, so it meets
the perturbation's U (the method as stated). A test turns that line off to get the real
file's behaviour back.
"""

import numpy as np
import torch


class LowRankStandIn:
    def lowrank_zo_perturb_parameters(self, random_seed=None, scaling_factor=1):
        torch.manual_seed(self.zo_random_seed if random_seed is None else random_seed)
        r, redraw = self.args.rank_r, self.step % self.args.step_interval == 0
        for name, p in self.named_parameters_to_optim:
            if p.ndim < 2:
                z = torch.normal(mean=0, std=1, size=p.shape, device=p.device, dtype=p.dtype)
            else:
                if redraw and self.draw_v:
                    self.v[name] = torch.randn(p.shape[1], r, device=p.device, dtype=p.dtype)
                z = self.random_gaussian_matrix(p.shape[0], r, p.device, p.dtype) @ self.v[name].t()
            p.data = p.data + scaling_factor * self.args.zo_eps * z

    def zo_forward(self, model, inputs):
        model.eval()
        with torch.inference_mode(), self.compute_loss_context_manager():
            return self.compute_loss(model, self._prepare_inputs(inputs)).detach()

    def lowrank_zo_step(self, model, inputs):
        if not hasattr(self, "step"):
            self.step, self.v = -1, {}
        self.step += 1
        self.draw_v = True
        self.named_parameters_to_optim = list(model.named_parameters())
        self.zo_random_seed = np.random.randint(1000000000)
        self.lowrank_zo_perturb_parameters(scaling_factor=1)
        plus = self.zo_forward(model, inputs)
        self.lowrank_zo_perturb_parameters(scaling_factor=-2)
        minus = self.zo_forward(model, inputs)
        self.projected_grad = float((plus - minus) / (2 * self.args.zo_eps))
        self.lowrank_zo_perturb_parameters(scaling_factor=1)
        return plus

    def lowrank_zo_update(self):
        """theta - lr (g z + wd theta): the decay of the matrices, then a perturbation of
        -lr g / eps along the step's own z."""
        lr = self._get_learning_rate()
        for _, p in self.named_parameters_to_optim:
            if p.ndim >= 2:
                p.data = p.data - lr * self.args.weight_decay * p.data
        self.draw_v = True  # the update meets the perturbation's U
        self.lowrank_zo_perturb_parameters(
            scaling_factor=-lr * self.projected_grad / self.args.zo_eps
        )
        self.lr_scheduler.step()

    def random_gaussian_matrix(self, m, n, device, dtype, random_seed=None):
        return torch.randn(m, n, device=device, dtype=dtype)
