"""Stand-in for ZO2's offload (see ../../../README.md): each unit's two passes run back to
back, and a step's update waits for the next step's pass, where each unit first replays
the previous step's z from its saved generator state."""
# ruff: noqa: F821
# mypy: ignore-errors


class MeZO2SGD(MeZOSGD):
    def __init__(self, model, config):
        super().__init__(model, config)
        self.device = config.working_device
        self.init_zo2()

    def init_zo2(self):
        self.rstate = self.last_rstate = None
        self.rstate_queue = deque(maxlen=2)
        self.projected_grad = 0
        self.init_zo2_upload()

    def zo_update(self, module, weight_decay=None):
        torch.cuda.set_rng_state(self.last_rstate)
        super().zo_update(module, weight_decay=weight_decay)
        self.last_rstate = torch.cuda.get_rng_state()
        return module

    def module_dual_forward(self, module, inputs1, inputs2, projected_grad=0.0, weight_decay=None):
        if projected_grad != 0:
            self.zo_update(module, weight_decay)
        outputs = []
        for shift, inputs in zip(self.zo_perturb_shifts()[:2], (inputs1, inputs2)):
            torch.cuda.set_rng_state(self.rstate)
            self.zo_perturb_parameters(module, scaling_factor=shift)
            outputs.append(module(**inputs))
        torch.cuda.set_rng_state(self.rstate)
        self.zo_perturb_parameters(module, scaling_factor=self.zo_perturb_shifts()[2])
        self.rstate = torch.cuda.get_rng_state()
        return tuple(outputs)

    @torch.inference_mode()
    def zo_forward(self, *args, **kwargs):
        self._update_lr()
        torch.cuda.manual_seed(np.random.randint(self.max_zo_random_seed))
        self.rstate = torch.cuda.get_rng_state()
        self.rstate_queue.append(self.rstate.clone())
        if len(self.rstate_queue) == 2:
            self.last_rstate = self.rstate_queue.popleft()
        loss1, loss2 = self.inner_zo_forward(*args, **kwargs)
        self.projected_grad = self.compute_grad(loss1, loss2)
        return loss1
