"""ZO2's offload units (``--zo2`` in its ``zo2=True`` mode): the modules its model classes
hand ``task_compute_module`` one at a time, the weight decay each call passes, and the
order in which its generator draws their z.

OPT's are its embeddings, ``project_in``, each layer, the final norm with weight decay 0,
``project_out`` and the head; Qwen3's are read off ZO2's
``zo2/model/huggingface/qwen3/mezo_sgd/zo2.py`` (each module with parameters that its
training forwards hand ``task_compute_module``, with the ``weight_decay`` each call
passes), so a change of ZO2's choice there is the check's too. In the check the model's
own forward runs on the batch twice over, and at each unit (``DualUnit``) ZO2's
``module_dual_forward`` takes the two halves as its two passes.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import torch

# the file of ZO2's Qwen3 offload, its optimizers and the module each one's ``self.model`` is
ZO2_QWEN3_MODEL = "zo2/model/huggingface/qwen3/mezo_sgd/zo2.py"
ZO2_QWEN3_OPTIMIZERS = (("OptimizerQwen3Model", "model"), ("OptimizerQwen3ForCausalLM", ""))


def split_rows(value: Any, rows: int) -> tuple[Any, Any]:
    """The two passes' halves of an argument with the doubled batch's rows, else itself."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == 2 * rows:
        return value[:rows], value[rows:]
    return value, value


def joined(first: Any, second: Any) -> Any:
    if isinstance(first, torch.Tensor):
        return torch.cat([first, second])
    if isinstance(first, tuple):
        return tuple(joined(a, b) for a, b in zip(first, second, strict=True))
    return first


class DualUnit(torch.nn.Module):
    """One of ZO2's offload units (an embedding, a decoder layer, a norm, the head) inside
    the model's own forward. The batch arrives doubled; its halves are ZO2's two passes,
    which its ``module_dual_forward`` runs as written: the previous step's update, then
    the unit at +eps z and at -eps z, then the restore. (ZO2's ``task_compute_module``
    adds only CUDA stream waits and an autocast that is off by default.)"""

    def __init__(self, unit: torch.nn.Module, optimizer: Any, weight_decay: float | None):
        super().__init__()
        self.unit, self.weight_decay = unit, weight_decay
        self.optimizer = [optimizer]  # a list: not a submodule of the model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(self.unit.forward).bind(*args, **kwargs)
        named = dict(bound.arguments)
        named.update(named.pop("kwargs", {}))
        optimizer = self.optimizer[0]
        halves = [split_rows(v, optimizer.rows) for v in named.values()]
        first = dict(zip(named, (h[0] for h in halves), strict=True))
        second = dict(zip(named, (h[1] for h in halves), strict=True))
        out = optimizer.module_dual_forward(
            self.unit, first, second, optimizer.projected_grad, self.weight_decay
        )
        return joined(*out)


def zo2_units(
    checkout: Path, family: str, model: Any
) -> list[tuple[str, torch.nn.Module, float | None]]:
    """ZO2's offload units of the family's model with the weight decay its model code
    passes each (None: its rule by name), by module name; Qwen3's read off ZO2's file."""
    if family == "qwen3":
        return zo2_qwen3_units(checkout, model)
    return zo2_opt_units(model)


def zo2_qwen3_units(
    checkout: Path, model: torch.nn.Module
) -> list[tuple[str, torch.nn.Module, float | None]]:
    """The modules (with parameters) that ZO2's Qwen3 offload hands ``task_compute_module``
    in its training forwards (``inner_zo_forward``), and the ``weight_decay`` each call
    passes, as written in its file: which tensors it perturbs, unit by unit, is ITS choice
    (a tied head, a unit of its own, is drawn for again)."""
    source = checkout / ZO2_QWEN3_MODEL  # zo2_checkout: there
    classes = {n.name: n for n in ast.parse(source.read_text()).body if isinstance(n, ast.ClassDef)}
    named = {module: name for name, module in model.named_modules()}
    units: dict[str, tuple[torch.nn.Module, float | None]] = {}
    for cls, owner in ZO2_QWEN3_OPTIMIZERS:
        body = classes[cls].body if cls in classes else []
        forward = [
            f for f in body if isinstance(f, ast.FunctionDef) and f.name == "inner_zo_forward"
        ]
        if not forward:
            raise SystemExit(f"{source}: no {cls}.inner_zo_forward; is it ZO2's?")
        for call in ast.walk(forward[0]):
            if not (
                isinstance(call, ast.Call)
                and ast.unparse(call.func).endswith("task_compute_module")
            ):
                continue
            keywords = {k.arg: k.value for k in call.keywords}
            path = ast.unparse(call.args[0] if call.args else keywords["module"])
            attribute = path.removeprefix("self.model.").split("[")[0]  # layers[i-1]: each layer
            module = model.get_submodule(".".join(filter(None, (owner, attribute))))
            given = keywords.get("weight_decay")
            decay = None if given is None else float(ast.literal_eval(given))
            for unit in list(module.children()) if "[" in path else [module]:
                if not any(True for _ in unit.parameters()):  # rotary_emb: nothing to draw
                    continue
                if units.get(named[unit], (unit, decay))[1] != decay:
                    raise SystemExit(f"{source}: {cls} decays {path} unlike its other calls")
                units[named[unit]] = (unit, decay)
    return [(name, unit, decay) for name, (unit, decay) in units.items()]


def zo2_opt_units(model: Any) -> list[tuple[str, torch.nn.Module, float | None]]:
    """ZO2's offload units of an OPT with the weight decay ZO2's OPT model passes each
    (``OptimizerOPTDecoder.inner_zo_forward``: 0 for the final layer norm, else its
    name rule), by module name."""
    decoder = model.model.decoder
    named = {module: name for name, module in model.named_modules()}
    units = [decoder.embed_tokens, decoder.embed_positions, decoder.project_in]
    units += [*decoder.layers, decoder.final_layer_norm, decoder.project_out, model.lm_head]
    return [
        (named[u], u, 0.0 if u is decoder.final_layer_norm else None)
        for u in units
        if u is not None
    ]


def zo2_walk(model: torch.nn.Module, units: list[tuple[str, torch.nn.Module, Any]]) -> list[str]:
    """The trained parameters in the order ZO2's offload draws their z: unit by unit as
    the forward calls them (recorded on a forward), each unit's own order within; a tied
    tensor once per unit that holds it."""
    called: list[str] = []
    hooks = [
        unit.register_forward_pre_hook(lambda *_, name=name: called.append(name))
        for name, unit, _ in units
    ]
    with torch.no_grad():
        model(torch.ones(1, 2, dtype=torch.long))
    for hook in hooks:
        hook.remove()
    units_by_name = {name: unit for name, unit, _ in units}
    walk = [
        f"{name}.{p_name}"
        for name in called
        for p_name, p in units_by_name[name].named_parameters()
        if p.requires_grad
    ]
    walked = {id(model.get_parameter(name)) for name in walk}
    missed = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in walked]
    if missed:
        raise SystemExit(f"ZO2's units miss {missed}")
    return walk
