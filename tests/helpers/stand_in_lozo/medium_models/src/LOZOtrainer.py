"""A stand-in for LOZO's RoBERTa trainer file (the one with LOZO-M), read by
benchmarks/peer_lozo.py --momentum in the tests.

Written for the tests from LOZO-M's formulas (not from LOZO's code): the methods carry
the names and arguments benchmarks/peer_lozo.py parses out of the real file, and draw
from ``torch`` and ``np`` as it does. Per matrix the momentum is an m x r factor N:
N = g U on the first step, N (V_old^T V) / n projected onto a redrawn V, then
N = beta1 N + (1 - beta1) g U and W -= lr (N V^T + wd W); a 1-D tensor's is dense.
"""

import numpy as np
import torch


class LowRankMomentumStandIn:
    def lowrank_zo_perturb_parameters(self, random_seed=None, scaling_factor=1):
        torch.manual_seed(self.zo_random_seed if random_seed is None else random_seed)
        r, redraw = self.args.rank, self.step % self.args.step_interval == 0
        for name, p in self.named_parameters_to_optim:
            if p.ndim < 2:
                z = torch.normal(mean=0, std=1, size=p.shape, device=p.device, dtype=p.dtype)
            else:
                if redraw:
                    self.v[name] = torch.randn(p.shape[1], r, device=p.device, dtype=p.dtype)
                z = self.random_gaussian_matrix(p.shape[0], r, p.device, p.dtype) @ self.v[name].t()
            p.data = p.data + scaling_factor * self.args.zo_eps * z

    def zo_forward(self, model, inputs):
        model.eval()
        with torch.inference_mode(), self.compute_loss_context_manager():
            return self.compute_loss(model, self._prepare_inputs(inputs)).detach()

    def lowrank_zo_step(self, model, inputs):
        if not hasattr(self, "step"):
            self.step, self.v, self.v_window, self.exp_avg_m = -1, {}, {}, {}
        self.step += 1
        self.v_old = dict(self.v)  # the V the last window used, before any redraw
        self.named_parameters_to_optim = list(model.named_parameters())
        self.zo_random_seed = np.random.randint(1000000000)
        self.lowrank_zo_perturb_parameters(scaling_factor=1)
        plus = self.zo_forward(model, inputs)
        self.lowrank_zo_perturb_parameters(scaling_factor=-2)
        minus = self.zo_forward(model, inputs)
        self.projected_grad = float((plus - minus) / (2 * self.args.zo_eps))
        self.lowrank_zo_perturb_parameters(scaling_factor=1)
        return plus

    def lowrank_zo_update_momentum(self):
        """Draws U per matrix and z per 1-D tensor, in the perturbation's order."""
        torch.manual_seed(self.zo_random_seed)
        lr, g, beta1 = self._get_learning_rate(), self.projected_grad, self.args.beta1
        redraw = self.step % self.args.step_interval == 0
        for name, p in self.named_parameters_to_optim:
            if p.ndim >= 2:
                v = self.v[name]
                u = self.random_gaussian_matrix(p.shape[0], self.args.rank, p.device, p.dtype)
                if self.step == 0:
                    self.exp_avg_m[name] = g * u
                else:
                    m = self.exp_avg_m[name]
                    if redraw:
                        m = m @ (self.v_old[name].t() @ v) / v.shape[0]
                    self.exp_avg_m[name] = beta1 * m + (1 - beta1) * g * u
                decay = self.args.weight_decay * p.data
                p.data = p.data - lr * (self.exp_avg_m[name] @ v.t() + decay)
            else:
                z = torch.normal(mean=0, std=1, size=p.shape, device=p.device, dtype=p.dtype)
                if self.step == 0:
                    self.exp_avg_m[name] = g * z
                else:
                    self.exp_avg_m[name] = beta1 * self.exp_avg_m[name] + (1 - beta1) * g * z
                p.data = p.data - lr * self.exp_avg_m[name]
        self.lr_scheduler.step()

    def random_gaussian_matrix(self, m, n, device, dtype, random_seed=None):
        return torch.randn(m, n, device=device, dtype=dtype)
