"""Stand-in for ZO2's optimizer base (see ../../README.md): one parameter group."""
# ruff: noqa: F821  (the names the script gives the classes)
# mypy: ignore-errors


class BaseOptimizer(Optimizer):
    def __init__(self, params, defaults):
        super().__init__(params, defaults)
        self.lr = defaults["lr"]

    def _update_lr(self):
        self.lr = self.param_groups[0]["lr"]
