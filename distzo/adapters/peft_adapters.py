"""Adapters through ``peft``: LoRA (MeZO's LoRA runs) and LoRA-FA (P-RGE's default) on a
frozen base.

peft injects its layers into the model's own modules; the engine then perturbs and
updates only the parameters that require grad (the adapter, ``engine.trainable_selector``)
and streams the frozen base read-only: uploaded each step, never written back.

* ``lora``: ``A`` and ``B`` of every target module are trained (MeZO perturbs both).
* ``lora-fa``: ``A`` stays at its random init and only ``B`` is trained, as in P-RGE
  (peft's ``create_lorafa_optimizer`` freezes ``lora_A`` the same way).
* ``prefix``: peft's prefix tuning (``PrefixTuningConfig``, no reparameterisation, as
  MeZO): virtual tokens' keys and values in every layer. Each block gets its columns of
  peft's table as a ``BlockPrefix`` (``distzo.models.prefix``), so a streamed block carries
  its own prefix; the export writes peft's table back. Initialised as MeZO does by default
  (``real``: the keys and values the model itself computes for random tokens) or by
  peft's own random init (``random``).

Dropout is refused: the two perturbed passes of a step must compute one function.
The adapter's initial values come from peft's own init (``reset_lora_parameters``:
``A`` Kaiming-uniform, ``B`` zero) under a generator seeded by the run seed, so every
rank, a resumed run and a replay rebuild the same ``A``, also on a skeleton model whose
base never exists whole in memory.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # peft is imported where an adapter is used (its import is heavy)
    from peft import LoraConfig, PeftModel

    from distzo.models.weights import Expected, Unexpected

PEFT_METHODS = ("none", "lora", "lora-fa", "prefix")
PREFIX_INITS = ("real", "random")
ADAPTER_NAME = "default"  # peft's name of a model's one adapter
PEFT_PREFIX = "base_model.model."  # what a peft model's names (and its state's keys) start with


@dataclass(frozen=True)
class AdapterSpec:
    """What to train: ``method`` none (every parameter), lora or lora-fa; rank, alpha and
    target module names (None: peft's default for the model family, q_proj and v_proj
    for OPT and the Llama family, as MeZO and peft do)."""

    method: str = "none"
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None
    prefix_length: int = 5  # MeZO's num_prefix
    prefix_init: str = "real"  # MeZO's prefix_init_by_real_act

    def validate(self) -> None:
        if self.method not in PEFT_METHODS:
            raise ValueError(f"--peft {self.method!r} is not one of {', '.join(PEFT_METHODS)}")
        if self.r < 1:
            raise ValueError(f"--lora-r must be >= 1, got {self.r}")
        if not self.alpha > 0:
            raise ValueError(f"--lora-alpha must be > 0, got {self.alpha}")
        if self.dropout != 0:
            raise ValueError(
                f"--lora-dropout {self.dropout}: the two perturbed passes of a ZO step must "
                "compute one function, and dropout draws a different one each pass; "
                "drop --lora-dropout (0)"
            )
        if self.targets is not None and not self.targets:
            raise ValueError(
                "--lora-targets names no module; give names such as q_proj,v_proj or leave it out"
            )
        if self.prefix_length < 1:
            raise ValueError(f"--prefix-length must be >= 1, got {self.prefix_length}")
        if self.prefix_init not in PREFIX_INITS:
            raise ValueError(
                f"--prefix-init {self.prefix_init!r} is not one of {', '.join(PREFIX_INITS)}"
            )

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def check_default_targets(self, model_type: str) -> None:
        """A LoRA run without ``--lora-targets`` on a family that peft has no default
        targets for is refused in one line before any model is built (peft says so only
        once the adapter is attached, after the model's skeleton)."""
        if self.method not in ("lora", "lora-fa") or self.targets:
            return
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

        if model_type not in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING:
            raise ValueError(
                f"--peft {self.method}: peft has no default target modules for model type "
                f"{model_type!r}; name them with --lora-targets (the attention projections, "
                "such as q_proj,v_proj, or Phi-3's qkv_proj)"
            )

    @classmethod
    def parse_targets(cls, text: str | None) -> tuple[str, ...] | None:
        """``q_proj,v_proj`` -> ("q_proj", "v_proj"); None or empty: the family's default."""
        if text is None:
            return None
        return tuple(t.strip() for t in text.split(",") if t.strip())

    def record(self) -> dict:
        """How the run's log and checkpoint metadata name the adapter (a replay rebuilds it)."""
        return {
            "method": self.method,
            "r": self.r,
            "alpha": self.alpha,
            "targets": list(self.targets) if self.targets else None,
            "prefix_length": self.prefix_length,
            "prefix_init": self.prefix_init,
        }

    @classmethod
    def from_record(cls, record: dict | None) -> AdapterSpec:
        if not record:
            return cls()
        targets = record.get("targets")
        return cls(
            record["method"],
            int(record["r"]),
            float(record["alpha"]),
            0.0,
            tuple(targets) if targets else None,
            int(record.get("prefix_length", 5)),
            record.get("prefix_init", "real"),
        )


# transformers 5's deprecation of a name peft still reads when it wraps a model: a
# FutureWarning every run printed, about code that is neither the user's nor distzo's
_PEFT_READS_DEPRECATED = r"`is_gradient_checkpointing` is deprecated"


@contextlib.contextmanager
def _without_peft_deprecations() -> Iterator[None]:
    """Inside, peft's use of names transformers deprecated says nothing: the user can act
    on neither (peft will follow transformers)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_PEFT_READS_DEPRECATED, category=FutureWarning)
        yield


def attach_adapter(model: nn.Module, spec: AdapterSpec, seed: int) -> nn.Module:
    """``peft.get_peft_model(model, LoraConfig(...))`` with its adapter initialised from
    ``seed`` (on CPU where the model is a meta skeleton) and, for lora-fa, ``A`` frozen;
    for prefix, ``PrefixTuningConfig`` and a ``BlockPrefix`` in every block."""
    if spec.method == "prefix":
        return _attach_prefix(model, spec, seed)
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    from distzo.models.family import CAUSAL
    from distzo.models.registry import family_for

    config = LoraConfig(
        r=spec.r,
        # peft annotates lora_alpha as int, but only divides it by r: a float is what
        # --lora-alpha takes and what peft's own configs store
        lora_alpha=spec.alpha,  # type: ignore[arg-type]
        lora_dropout=0.0,
        bias="none",
        # peft has no masked-LM task: a masked LM's adapter is a plain PeftModel, which
        # PeftModel.from_pretrained loads onto AutoModelForMaskedLM's model
        task_type="CAUSAL_LM" if family_for(model).lm_kind == CAUSAL else None,
        target_modules=list(spec.targets) if spec.targets else _default_targets(model),
    )
    _check_linear_targets(model, config, spec.method)
    with torch.random.fork_rng(devices=[]):  # the caller's generator state is left as it was
        try:
            with _without_peft_deprecations():
                peft_model = get_peft_model(model, config)
        except ValueError as err:  # no target module matched, or a family peft has no default for
            line = str(err).splitlines()[0]
            raise ValueError(
                f"--peft {spec.method}: {line} (set --lora-targets to some of the model's "
                f"linear layers: {', '.join(_linear_names(model))})"
            ) from None
        torch.manual_seed(seed)
        for module in peft_model.modules():
            if isinstance(module, LoraLayer):
                for part in (module.lora_A, module.lora_B):
                    layer = part[ADAPTER_NAME]
                    # a skeleton's adapter: give it memory before peft's init
                    if layer.weight.is_meta:
                        layer.to_empty(device="cpu")
                module.reset_lora_parameters(ADAPTER_NAME, True)
    if spec.method == "lora-fa":
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.requires_grad_(False)
    return peft_model


def _default_targets(model: nn.Module) -> list[str] | None:
    """peft's own default LoRA targets for ``model``'s type, given to it explicitly: peft
    turns targets left unset into none at all for a model whose checkpoints transformers
    renames as it loads them (Mixtral's ``block_sparse_moe``), then refuses to find any."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    model_type = getattr(getattr(model, "config", None), "model_type", "")
    found = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(str(model_type))
    return list(found) if found else None


def name_base_revision(peft_model: nn.Module, revision: str | None) -> None:
    """Record the hub commit the base was read at as the adapter's ``revision``, which
    ``AutoPeftModelForCausalLM`` loads the base at (else the hub's newest ``main``, maybe
    other weights than the adapter was trained on)."""
    for config in getattr(peft_model, "peft_config", {}).values():
        config.revision = revision


def _lora_layers(peft_model: nn.Module) -> Iterator[tuple[str, nn.Module, str | None]]:
    """Each LoRA layer of ``peft_model``: its module name in the base model, the layer it
    adapts, and that layer's kind when it is not linear (peft keeps an embedding's factors
    elsewhere, ``lora_embedding_A``, which neither the init nor the merge here reads)."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            base: nn.Module = module.get_base_layer()
            not_linear = None if isinstance(module, LoraLinear) else type(base).__name__
            yield name.removeprefix(PEFT_PREFIX), base, not_linear


def _linear_names(model: nn.Module) -> list[str]:
    """The names ``--lora-targets`` can take: each linear layer's own name, once, in the
    model's order, the LM head left out (peft's matcher reads the name's last part)."""
    from transformers.pytorch_utils import Conv1D

    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    names = (
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, Conv1D)) and module is not head
    )
    return list(dict.fromkeys(names))


def _check_linear_targets(model: nn.Module, config: LoraConfig, method: str) -> None:
    """LoRA on linear layers only, checked before peft adapts any module: each that
    ``config`` targets, found by peft's own matcher, is one its LoRA ``Linear`` wraps
    (``nn.Linear``, transformers' ``Conv1D``). peft itself refuses a mixture's experts (3-D
    parameters) only after adapting the modules before them, printing the module over
    several lines, and adapts an embedding, but not as a linear layer (``_lora_layers``)."""
    from peft.tuners.tuners_utils import check_target_module_exists
    from transformers.pytorch_utils import Conv1D

    if config.target_modules is None:  # none named and no default: peft says so
        return
    # the example is the model's own (RoBERTa's query,value), not a module it lacks
    example = ",".join(_default_targets(model) or ("q_proj", "v_proj"))
    for name, module in model.named_modules():
        if check_target_module_exists(config, name) and not isinstance(module, (nn.Linear, Conv1D)):
            raise ValueError(
                f"--lora-targets: {name} ({type(module).__name__}) is not a linear layer; "
                f"--peft {method} trains LoRA on linear layers only (such as {example})"
            )


def merge_problem(peft_model: nn.Module) -> str | None:
    """Why the adapter cannot be merged into the base's weights here, with what else to do
    (None: it can be): the merge adds ``scaling * B @ A`` to each LoRA linear's own weight,
    and nothing else."""
    instead = "export the adapter itself (drop --merge-adapter)"
    config = getattr(peft_model, "peft_config", {}).get(ADAPTER_NAME)
    for option in ("use_dora", "lora_bias", "modules_to_save"):
        if getattr(config, option, None):
            return f"the adapter's {option} is not merged here; {instead}"
    owners: dict[int, list[str]] = {}
    for name, param in peft_model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name.removeprefix(PEFT_PREFIX))
    for name, base, not_linear in _lora_layers(peft_model):
        leave_out = f"leave {name} out of --lora-targets, or {instead}"
        if not_linear is not None:
            return f"the LoRA on {name} ({not_linear}) does not merge; {leave_out}"
        shared = [n for n in owners[id(base.weight)] if not n.startswith(name)]
        if shared:
            return (
                f"the LoRA on {name} would change {shared[0]} too, which shares its weight "
                f"(tied embeddings); {leave_out}"
            )
    return None


def check_adapter_name(peft_model: nn.Module) -> None:
    """A one-line error, before any step, for a peft model whose adapters are not one named
    ``default``: distzo trains, merges and exports that one (under another name the export
    was a bare ``KeyError`` and the merge silently left the adapter out)."""
    names = sorted(getattr(peft_model, "peft_config", {}))
    if names != [ADAPTER_NAME]:
        raise ValueError(
            f"the peft model's adapters are {names}; distzo trains one adapter named "
            f"{ADAPTER_NAME!r}: wrap the model with get_peft_model(model, config), leaving "
            "adapter_name at its default"
        )


def check_mergeable(peft_model: nn.Module) -> None:
    """A one-line error, before training or an export starts, for an adapter that does not
    merge (``merge_problem``)."""
    problem = merge_problem(peft_model)
    if problem is not None:
        raise ValueError(f"--merge-adapter: {problem}")


def _attach_prefix(model: nn.Module, spec: AdapterSpec, seed: int) -> nn.Module:
    from peft import PrefixTuningConfig, get_peft_model

    from distzo.models.family import CAUSAL
    from distzo.models.registry import family_for

    family = family_for(model)
    # peft has no masked-LM task: an encoder's prefix is FEATURE_EXTRACTION's, whose model
    # hands the base its prefix cache and widened mask and returns the base's own output
    # (a masked LM's logits); PeftModel.from_pretrained loads it so onto the masked LM
    causal = family.lm_kind == CAUSAL
    config = PrefixTuningConfig(
        num_virtual_tokens=spec.prefix_length,
        task_type="CAUSAL_LM" if causal else "FEATURE_EXTRACTION",
    )
    with torch.random.fork_rng(devices=[]):
        with _without_peft_deprecations():
            peft_model = get_peft_model(model, config)
        table = prefix_embedding(peft_model)
        if table.weight.is_meta:  # a skeleton's table: give it memory, on CPU
            table.to_empty(device="cpu")
        # peft's own init (N(0, 1)), drawn here from the seed alone: peft draws it before it
        # moves the table to a skeleton's meta device, so redrawing only a skeleton's would
        # give a streamed --model and its replay another prefix than a model built whole
        torch.manual_seed(seed)
        table.reset_parameters()
    prefixes = install_block_prefixes(peft_model, family.blocks())
    # MeZO: the keys and values of random tokens, computed by the engine
    if spec.prefix_init == "real":
        tokens = torch.randint(
            family.model.config.vocab_size,
            (1, spec.prefix_length),
            generator=torch.Generator().manual_seed(seed),
        )
        for prefix in prefixes:
            prefix.init_tokens = tokens
    return peft_model


def as_peft_model(model: nn.Module | None) -> PeftModel:
    """``model`` as the ``peft.PeftModel`` that ``attach_adapter`` made of it."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise TypeError(f"expected a peft.PeftModel, got a {type(model).__name__}")
    return model


def prefix_embedding(peft_model: nn.Module) -> nn.Embedding:
    """peft's prefix table: the prompt encoder's embedding (no projection, as MeZO)."""
    table = peft_model.get_submodule(f"prompt_encoder.{ADAPTER_NAME}.embedding")
    if not isinstance(table, nn.Embedding):
        raise TypeError(f"peft's prefix table is a {type(table).__name__}, not an embedding")
    return table


def is_prefix_tuned(peft_model: nn.Module | None) -> bool:
    return (
        peft_model is not None
        and getattr(as_peft_model(peft_model).peft_config.get(ADAPTER_NAME), "peft_type", None)
        == "PREFIX_TUNING"
    )


def install_block_prefixes(peft_model: nn.Module, blocks: list[nn.Module]) -> list[Any]:
    """Give every block its columns of peft's prefix table as a ``BlockPrefix`` (trained;
    the table itself is frozen and only rewritten at export). Idempotent."""
    from peft import PrefixTuningConfig

    from distzo.models.prefix import BlockPrefix

    config = as_peft_model(peft_model).peft_config[ADAPTER_NAME]
    if not isinstance(config, PrefixTuningConfig):
        raise TypeError(f"the model's adapter is a {type(config).__name__}, not a prefix")
    if config.prefix_projection:
        raise ValueError(
            "prefix tuning with prefix_projection=True trains an MLP outside the blocks; "
            "use PrefixTuningConfig(prefix_projection=False), as MeZO"
        )
    if config.num_layers != len(blocks):
        raise ValueError(
            f"the prefix has {config.num_layers} layers but the model streams {len(blocks)} blocks"
        )
    table = prefix_embedding(peft_model).weight
    width, heads = config.token_dim, config.num_attention_heads
    assert heads is not None  # get_peft_model fills it in from the model's config
    for i, block in enumerate(blocks):
        if getattr(block, "prefix_tuning", None) is None:
            columns = table.detach()[:, 2 * width * i : 2 * width * (i + 1)]
            dtype = next(block.parameters()).dtype
            key_values = (
                columns.reshape(config.num_virtual_tokens, 2, heads, width // heads)
                .to(dtype)
                .clone()
            )
            block.prefix_tuning = BlockPrefix(key_values, i)
    table.requires_grad_(False)
    return [block.prefix_tuning for block in blocks]


def prefix_table(block_values: list[torch.Tensor]) -> torch.Tensor:
    """peft's prefix table (``prompt_embeddings``) from the blocks' prefixes, in layer order."""
    return torch.cat([v.reshape(v.shape[0], -1) for v in block_values], dim=1)


def base_name(name: str) -> str:
    """The name of a base parameter in the original checkpoint (peft moves a target's
    weight under ``base_layer``)."""
    return name.replace(".base_layer.", ".")


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".prefix_tuning." in name


class AdapterWeights:
    """A ``WeightSource`` for a model with an adapter: the adapter's initial values from
    the model itself, every base tensor from the checkpoint under its original name."""

    def __init__(self, base, model: nn.Module) -> None:
        self.base = base
        # A prefix is named as in the base model, which holds the blocks' prefixes.
        source = as_peft_model(model).get_base_model() if is_prefix_tuned(model) else model
        self.adapter = {
            n: p.detach().clone() for n, p in source.named_parameters() if is_adapter_name(n)
        }

    def _own(self, names: tuple[str, ...]) -> torch.Tensor | None:
        for name in names:
            for key in (name, PEFT_PREFIX + name):
                if key in self.adapter:
                    return self.adapter[key]
        return None

    def tensor(self, names, shape, dtype):
        own = self._own(names)
        if own is not None:
            return own.to(dtype)
        return self.base.tensor(tuple(base_name(n) for n in names), shape, dtype)

    def tensor_range(self, names, shape, dtype, start, stop):
        own = self._own(names)
        if own is not None:
            return own.to(dtype).reshape(-1)[start:stop]
        return self.base.tensor_range(tuple(base_name(n) for n in names), shape, dtype, start, stop)

    def check_shapes(self, expected: Expected, unexpected: Unexpected | None = None) -> None:
        """The base's tensors checked against its checkpoint (``check_weights``) under their
        original names, and what else it holds with them; the adapter's own come from the
        model, which has their shapes."""
        check = getattr(self.base, "check_shapes", None)
        if check is None:  # a source that cannot tell from headers (.bin, random weights)
            return
        base = [
            (tuple(base_name(n) for n in names), shape)
            for names, shape in expected
            if self._own(names) is None
        ]
        check(base, unexpected)
