"""The ZO2 peer of ``benchmarks/peers.py``: ZO2's own code, timed the way the harness times
every system.

    ZO2_PYTHON benchmarks/peer_zo2.py --zo2 PATH --system zo2-mezo --shape opt-1.3b \\
        --batch 1 --seq 2048 --dtype fp16 --device cuda
    ZO2_PYTHON benchmarks/peer_zo2.py --zo2 PATH --system zo2-offload --shape qwen3-8b ...

Runs under ZO2's interpreter (``--zo2-python`` of the harness: ZO2 needs transformers 4.51),
so it imports neither distzo nor anything outside the standard library, torch, transformers
and the ZO2 checkout at ``--zo2`` (a clone of liangyuwang/zo2, never vendored here).

It builds the model as ZO2's speed tests do (``test/mezo_sgd/hf_opt/test_speed.py``,
``hf_qwen3/test_speed.py``): an ``OPTConfig`` or a ``Qwen3Config`` of the shape (the
values of that test's ``Qwen3Configs``, built here with transformers' class, since its
test utils start NVML on import) with ``tie_word_embeddings=False`` and
``max_position_embeddings = seq``, built under ``torch.set_default_dtype(dtype)``, then
``model.zo_init(MeZOSGDConfig(...))`` with that test's defaults (lr 1e-3, weight decay 0.1,
eps 1e-3). One difference, in how the random values are drawn, not in what is built: the
model's own initialisation is skipped (transformers' ``no_init_weights``) and its
parameters are then filled as OPT's and Qwen3's ``_init_weights`` fill them (matrices and
embeddings ~ N(0, 0.02), biases 0, norm scales 1), the Gaussians drawn in float32 a chunk
at a time, on the GPU in a CUDA run, and rounded to the model's dtype (``zo2-mezo``'s
model is moved to the GPU first and filled there). The default initialisation draws in
the default dtype, fp16 here, on the host: built that way, ZO2's peers took 88 s at
OPT-1.3B on the H100 machine (2026-11-27), distzo's, drawing in float32, 22 s, and
OPT-6.7B's six peers were not all built after the 340 s its device command allowed; one
host thread draws ~2e8 float32 Gaussians a second, 2.5 minutes for OPT-30B's.
``--threads`` sets a CPU run's torch threads; a CUDA run keeps torch's default, as
ZO2's speed test and distzo's peers do.
``zo2-mezo`` is ZO2's ``zo2=False`` model (MeZO-SGD, the whole model on the
device), ``zo2-offload`` its ``zo2=True`` model (blocks in host memory on three CUDA
streams; CUDA only). The shapes, and ``--hidden``'s rule, are distzo's
(``distzo/bench/peer_models.py``), copied here since this file runs without distzo;
tests/unit/test_peer_zo2.py holds the two equal. A step is
``model(input_ids=ids, labels=ids)`` in ``zo_train`` mode, which runs ZO2's whole step
(two perturbed passes and the update) and returns the loss.

The protocol (benchmarks/peers.py): one JSON line ``{"ready": ...}`` once built, then one
JSON line per request line ``{"steps": k}`` read from stdin; logs go to stderr.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

# The OPT shapes of ZO2's speed test (its OPTConfigs): hidden, layers, heads, ffn.
OPT_SHAPES = {
    "opt-125m": (768, 12, 12, 3072),
    "opt-350m": (1024, 24, 16, 4096),
    "opt-1.3b": (2048, 24, 32, 8192),
    "opt-2.7b": (2560, 32, 32, 10240),
    "opt-6.7b": (4096, 32, 32, 16384),
    "opt-13b": (5120, 40, 40, 20480),
    "opt-30b": (7168, 48, 56, 28672),
    "opt-66b": (9216, 64, 72, 36864),
    "opt-175b": (12288, 96, 96, 49152),
}
# The Qwen3 sizes of ZO2's Qwen3 speed test (its Qwen3Configs): hidden, layers, heads, kv
# heads, ffn; head_dim 128 and the 151,936-token vocabulary, Qwen3Config's defaults.
QWEN3_SHAPES = {
    "qwen3-0.6b": (1024, 28, 16, 8, 3072),
    "qwen3-1.7b": (2048, 28, 16, 8, 6144),
    "qwen3-4b": (2560, 36, 32, 8, 9728),
    "qwen3-8b": (4096, 36, 32, 8, 12288),
    "qwen3-14b": (5120, 40, 40, 8, 17408),
    "qwen3-32b": (5120, 64, 64, 8, 25600),
}
QWEN3_HEAD_DIM = 128
SHAPES = sorted(OPT_SHAPES) + sorted(QWEN3_SHAPES)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SYSTEMS = ("zo2-mezo", "zo2-offload")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zo2", required=True, help="a clone of liangyuwang/zo2")
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--shape", required=True, choices=SHAPES)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


class _Protocol:
    """The protocol's stream: the process's real stdout, taken before anything is imported.
    File descriptor 1 and ``sys.stdout`` then point at stderr, so that ZO2's own prints
    ("Upload head and tail to cuda.") cannot break the stream."""

    stream: Any = None

    @classmethod
    def take_stdout(cls) -> None:
        sys.stdout.flush()
        cls.stream = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr


def reply(message: dict[str, Any]) -> None:
    """One protocol line on the real stdout, flushed: the harness waits for it."""
    stream = _Protocol.stream if _Protocol.stream is not None else sys.stdout
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def fail(message: str) -> None:
    reply({"error": message})
    raise SystemExit(1)


def peak_rss_bytes() -> int:
    """VmHWM of this process (the harness compares every peer by the same figure)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


@functools.cache
def _process_device() -> Any:
    """distzo/bench/process_device.py, loaded once by its path: this interpreter cannot
    import distzo, and the harness compares every peer by the same figure."""
    path = os.path.join(os.path.dirname(__file__), "..", "distzo", "bench", "process_device.py")
    spec = importlib.util.spec_from_file_location("process_device", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def process_device_bytes() -> int | None:
    """NVML's figure for this process (the device memory nvidia-smi lists for it)."""
    return _process_device().process_device_bytes()


def model_config(args: argparse.Namespace) -> Any:
    """The config ZO2's speed test builds for the shape, with the harness's overrides:
    ``--layers``; ``--hidden`` H: OPT ffn 4 H and H / 64 heads; Qwen3 ffn 3 H, H / 128
    heads of head_dim 128, kv heads gcd(H / 128, the shape's)."""
    from transformers import OPTConfig, Qwen3Config

    if args.shape in OPT_SHAPES:
        hidden, layers, heads, ffn = OPT_SHAPES[args.shape]
        if args.hidden is not None:
            hidden, ffn, heads = args.hidden, 4 * args.hidden, max(1, args.hidden // 64)
        return OPTConfig(
            num_hidden_layers=args.layers or layers,
            num_attention_heads=heads,
            hidden_size=hidden,
            ffn_dim=ffn,
            max_position_embeddings=args.seq,
            tie_word_embeddings=False,
        )
    hidden, layers, heads, kv, ffn = QWEN3_SHAPES[args.shape]
    if args.hidden is not None:
        if args.hidden < QWEN3_HEAD_DIM or args.hidden % QWEN3_HEAD_DIM:
            fail(f"--hidden {args.hidden} must be a multiple of {QWEN3_HEAD_DIM} for Qwen3")
        hidden, ffn, heads = args.hidden, 3 * args.hidden, args.hidden // QWEN3_HEAD_DIM
        kv = math.gcd(heads, kv)
    layers = args.layers or layers
    return Qwen3Config(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_window_layers=layers,
        hidden_size=hidden,
        intermediate_size=ffn,
        head_dim=QWEN3_HEAD_DIM,
        max_position_embeddings=args.seq,
        use_sliding_window=False,
        tie_word_embeddings=False,
    )


FILL_CHUNK = 1 << 24  # float32 draws at a time: 64 MB of staging, whatever the model


@torch.no_grad()
def fill_random(model: torch.nn.Module, seed: int, std: float = 0.02, device: str = "cpu") -> None:
    """The values ``_init_weights`` of OPT and Qwen3 give (matrices and embeddings ~
    N(0, std), biases 0, norm scales 1), the Gaussians drawn in float32 on ``device`` and
    rounded there to each parameter's dtype a chunk at a time (the host's float32
    normal_ is its vectorised one; a GPU draws OPT-30B's 30e9 in well under a second,
    where one host thread takes minutes)."""
    g = torch.Generator(device).manual_seed(seed)
    staging = torch.empty(0, dtype=torch.float32, device=device)
    for name, p in model.named_parameters():
        if p.dim() < 2:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        flat = p.view(-1)
        for lo in range(0, flat.numel(), FILL_CHUNK):
            hi = min(lo + FILL_CHUNK, flat.numel())
            if staging.numel() < hi - lo:
                staging = torch.empty(hi - lo, dtype=torch.float32, device=device)
            drawn = staging[: hi - lo].normal_(0.0, std, generator=g)
            flat[lo:hi].copy_(drawn.to(p.dtype))


def build(args: argparse.Namespace) -> tuple[Any, int, int]:
    """ZO2's model of the shape, random init, as its speed test builds it."""
    config = model_config(args)  # bad widths first: one line, before ZO2 is imported
    if not os.path.isdir(os.path.join(args.zo2, "zo2")):
        fail(
            f"--zo2 {args.zo2}: not a ZO2 checkout (no zo2/ package inside); clone liangyuwang/zo2"
        )
    sys.path.insert(0, os.path.abspath(args.zo2))
    from zo2.config.mezo_sgd import MeZOSGDConfig  # type: ignore[import-not-found]

    if args.shape in OPT_SHAPES:
        from zo2.model.huggingface.opt.mezo_sgd import zo, zo2  # type: ignore[import-not-found]

        name = "OPTForCausalLM"
    else:
        from zo2.model.huggingface.qwen3.mezo_sgd import zo, zo2  # type: ignore[import-not-found]

        name = "Qwen3ForCausalLM"
    offload = args.system == "zo2-offload"
    device = "cuda:0" if args.device == "cuda" else "cpu"
    zo_config = MeZOSGDConfig(lr=1e-3, weight_decay=1e-1, eps=1e-3, working_device=device)
    zo_config.zo2 = offload
    if offload:
        zo_config.offloading_device = "cpu"
    # ZO2's interpreter has transformers 4.51 (5.x moved it)
    from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined]

    torch.manual_seed(args.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])
    try:
        with no_init_weights():
            model = getattr(zo2 if offload else zo, name)(config)
        if not offload:  # its values never touched on the host: filled where they live
            model = model.to(device)
        fill_random(model, args.seed, device=device)
        if args.device == "cuda":  # the draws' staging, out of the process's device figure
            torch.cuda.empty_cache()
        model.zo_init(zo_config)
    finally:
        torch.set_default_dtype(default)
    model.zo_train()
    return model, sum(p.numel() for p in model.parameters()), config.vocab_size


def timed_steps(
    step: Callable[[], torch.Tensor], steps: int, device: str
) -> tuple[list[float], float]:
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    samples, loss = [], float("nan")
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        out = step()
        sync()
        samples.append(time.perf_counter() - start)
        loss = float(out)
    return samples, loss


def serve(args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device here")
    if args.system == "zo2-offload" and args.device != "cuda":
        fail("zo2-offload needs CUDA (ZO2's offload runs on three CUDA streams)")
    if args.threads and args.device == "cpu":  # as distzo's peers: a CPU step's threads
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, parameters, vocab = build(args)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    ids = ids.to("cuda:0" if args.device == "cuda" else "cpu")
    reply(
        {
            "ready": True,
            "system": args.system,
            "parameters": parameters,
            "build_s": time.perf_counter() - started,
        }
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        steps = int(json.loads(line)["steps"])
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        samples, loss = timed_steps(lambda: model(input_ids=ids, labels=ids), steps, args.device)
        used = peak = process = None
        if args.device == "cuda":
            peak = torch.cuda.max_memory_allocated()
            free, total = torch.cuda.mem_get_info()
            used = total - free
            process = process_device_bytes()
        reply(
            {
                "step_s": samples,
                "loss": loss,
                "peak_rss_bytes": peak_rss_bytes(),
                "peak_device_bytes": peak,
                "device_used_bytes": used,
                "process_device_bytes": process,
            }
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _Protocol.take_stdout()
    try:
        serve(args)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - the harness needs one line, not a traceback
        print(f"peer_zo2: {type(exc).__name__}: {exc}", file=sys.stderr)
        fail(f"{args.system}: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
