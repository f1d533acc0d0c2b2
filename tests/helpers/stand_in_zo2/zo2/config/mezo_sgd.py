"""Stand-in for ZO2's MeZO-SGD config (see ../../README.md): the fields its steps read."""
# ruff: noqa: F821
# mypy: ignore-errors


@dataclass
class MeZOSGDConfig:
    lr: float = 1e-3
    weight_decay: float = 1e-1
    eps: float = 1e-3
    zo2: bool = True
    working_device: str = "cuda"
    offloading_device: str = "cpu"
    debug_mode: bool = False
    max_zo_random_seed = 1000000000
