"""Training throughput and memory: resident (MeZO) vs offload (ZO2) vs the parallel layouts.

    python benchmarks/throughput.py [--quick] [--shape opt-1.3b] [--layers 4] [--batch 8] \\
        [--seq 512]
    python benchmarks/throughput.py --shape opt-1.3b --sweep 1x128,2x256,4x512,8x512,16x512
    # P-RGE's layouts
    python benchmarks/throughput.py --compare-adapters --shape opt-125m --sweep 1x64,8x64
    torchrun --nproc_per_node=2 benchmarks/throughput.py     # adds PertP, DDP (and 2D on 4 ranks)
    # a step in micro-batches (a count, or at most N rows each): tokens/s and peak memory
    python benchmarks/throughput.py --shape mini --layers 1 --sweep 32x512 --skip-resident \
        --grad-accum 1,4 --micro-batch-rows 8,2

Single process: tokens/s and peak device memory of resident, offload without overlap
(one slot), offload with 2 slots and offload with K slots (default 3: the slot counts
side by side, ``offload_vs_2slots``), on a random-init model of the shape;
per-block upload/compute/offload times from the device timeline and the overlap
efficiency eta = max(upload, compute, offload) / (pipelined time per block).
Under torchrun it also runs, in the same process group and the same run: rank 0 alone
(the 1-rank baseline, same threads per rank), PertP, DDP and 2D, so the ratios
against resident and against 1 rank are taken side by side.

``--compare-head`` measures, on an SST-2-shaped classification batch (prompts of 8 to 48
tokens, two single-token candidates scored at the prompt's last position), the step time
with the LM head at the label positions against the full head (every position's
logits), side by side in one run, and the peak memory of one evaluation call done the
old way (full logits, float32 log-softmax of the whole batch) against the new (head at
the scored positions, ``HEAD_CHUNK`` rows at a time).

``--compare-adapters`` measures, at ``--num-queries`` q (default 4), full tuning against
LoRA-FA and LoRA-FA with P-RGE's batched passes: ``--dual-forward`` (a query's two passes
as one over the batch twice), ``--batch-queries`` (the q queries' passes of one sign as
one) and both (one pass over 2q copies), steps interleaved, tokens/s side by side.

``--sweep`` measures every layout at several batch x sequence points (each engine built
once) and reports where offload first reaches 0.95 x resident: the crossover, below
which a block's compute is too short to hide its transfers. Weights are drawn into the
host buckets block by block (``RandomWeights`` on a meta skeleton), as the trainer's
``--model-config`` does, so even large shapes are never materialised twice.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from distzo import ZOConfig, ZOEngine
from distzo.adapters.peft_adapters import AdapterSpec, AdapterWeights, attach_adapter
from distzo.bench import BenchReport, Measurement
from distzo.bench.arguments import at_least, counts
from distzo.bench.phases import block_phases
from distzo.bench.timing import Timer, synchronize
from distzo.dist import LaunchEnv, ParallelContext, ParallelDims
from distzo.dist import process_group as pg
from distzo.engine import UNPERTURBED
from distzo.models.shapes import SHAPES, shape_config
from distzo.models.tiny import tiny_opt_config
from distzo.models.weights import RandomWeights, WeightSource, skeleton
from distzo.objectives import ChoiceEncoding, Classification, candidate_scores, collate_choices
from distzo.objectives.choice import prepare_choices
from distzo.runtime.devices import device_name
from distzo.runtime.host_memory import peak_rss_bytes, reset_peak_rss, rss_bytes

logger = logging.getLogger("throughput")

# Two small shapes for CPUs (vocabulary 512); every named shape of distzo.models.shapes too.
SMALL_SHAPES = {"tiny": (64, 256, 4, 4), "mini": (256, 1024, 4, 4)}  # hidden, ffn, heads, layers
SHAPE_NAMES = sorted(SMALL_SHAPES) + SHAPES
CROSSOVER = 0.95  # offload / resident throughput at which the transfers count as hidden


def return_large_blocks() -> None:
    """On CPU, make glibc hand every large block back to the OS when it is freed (a fixed
    mmap threshold: its default one rises after frees and then keeps freed activations in
    the heap), so that RSS follows the activations of each layout, not the largest so far."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB
    except (OSError, AttributeError):
        pass  # not glibc: RSS figures then include what the allocator kept


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"1x128,8x512"`` -> [(1, 128), (8, 512)] (batch x sequence length)."""
    points = []
    for item in text.split(","):
        try:
            batch, seq = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise SystemExit(
                f"--sweep: {item!r} is not BATCHxSEQ; write e.g. --sweep 1x128,8x512"
            ) from None
        if batch < 1 or seq < 2:
            raise SystemExit(f"--sweep: {item!r} needs batch >= 1 and seq >= 2")
        points.append((batch, seq))
    return points


def point_name(batch: int, seq: int) -> str:
    return f"{batch}x{seq}"


def random_weights(device: torch.device) -> RandomWeights:
    """The benchmark's random model; on a GPU its Gaussians are drawn there (the host's
    generator would take most of a large shape's build)."""
    return RandomWeights(0, draw_device=device if device.type == "cuda" else None)


def model_config(shape: str, layers: int | None, seq: int) -> PretrainedConfig:
    if shape not in SMALL_SHAPES:
        config = shape_config(shape, layers)
        config.max_position_embeddings = max(seq, config.max_position_embeddings)
        return config
    hidden, ffn, heads, depth = SMALL_SHAPES[shape]
    return tiny_opt_config(
        vocab_size=512,
        hidden_size=hidden,
        ffn_dim=ffn,
        num_attention_heads=heads,
        num_hidden_layers=layers or depth,
        word_embed_proj_dim=hidden,
        max_position_embeddings=max(seq, 2048),
    )


class Bench:
    def __init__(self, args: argparse.Namespace, env: LaunchEnv, device: torch.device) -> None:
        self.args, self.env, self.device = args, env, device
        self.report = BenchReport("throughput", device_name(device), env.world_size)
        self.points = args.points
        self.config = model_config(args.shape, args.layers, max(seq for _, seq in self.points))
        self.compute = args.compute_dtype
        g = torch.Generator().manual_seed(0)
        self.batches = {
            (b, s): {"input_ids": torch.randint(3, self.config.vocab_size, (b, s), generator=g)}
            for b, s in self.points
        }

    def barrier(self) -> None:
        if self.env.world_size > 1:
            dist.barrier()

    def engine(
        self,
        mode: str,
        slots: int,
        parallel: ParallelContext,
        grad_accum: int = 1,
        optimizer: str = "sgd",
        micro_batch_rows: int = 0,
    ) -> ZOEngine:
        config = ZOConfig(
            lr=1e-7,
            eps=1e-3,
            seed=0,
            device=str(self.device),
            mode=mode,
            num_slots=slots,
            compute_dtype=self.compute,
            transfer="naive" if mode == "offload" else "auto",
            num_queries=self.args.num_queries,
            dual_forward=self.args.dual_forward,
            grad_accum=grad_accum,
            micro_batch_rows=micro_batch_rows,
            optimizer=optimizer,
            state_dtype=self.args.state_dtype
            if optimizer != "sgd" and mode == "offload"
            else "fp32",
            optimizer_state="stored" if optimizer == "momentum" else "auto",
        )
        model = skeleton(self.config, torch.float32)
        weights: WeightSource = random_weights(self.device)
        # an adapter: the base streams up only, the adapter stays on the device
        if self.args.peft != "none":
            model = attach_adapter(model, AdapterSpec(self.args.peft), seed=0)
            weights = AdapterWeights(weights, model)
        return ZOEngine(model, config, parallel=parallel, weights=weights)

    def measure(
        self,
        name: str,
        mode: str,
        slots: int,
        parallel: ParallelContext,
        participates: bool = True,
        grad_accum: int = 1,
        optimizer: str = "sgd",
        micro_batch_rows: int = 0,
        points: list[tuple[int, int]] | None = None,
    ) -> dict[tuple[int, int], Measurement]:
        """Time ``--steps`` steps of one layout at every point (or at ``points``); ranks
        outside it wait at the barrier."""
        self.barrier()
        if not participates:
            self.barrier()
            return {}
        engine = self.engine(mode, slots, parallel, grad_accum, optimizer, micro_batch_rows)
        out = {}
        for point in self.points if points is None else points:
            out[point] = m = self.measure_point(engine, name, point)
            if self.env.rank == 0:
                self.report.measurements.append(m)
                logger.info(
                    "%-14s %-9s %10.1f tokens/s  eta %.2f",
                    name,
                    point_name(*point),
                    m.metrics["tokens_per_s"],
                    m.metrics["eta"],
                )
        del engine
        if not parallel.is_distributed:
            self.barrier()  # the ranks that sat this one out wait here
        return out

    def measure_point(self, engine: ZOEngine, name: str, point: tuple[int, int]) -> Measurement:
        parallel = engine.parallel
        batch = self.batches[point]
        local = parallel.shard_batch(batch)
        tokens = batch["input_ids"].numel()  # the global batch: every layout does the same work
        items = engine.objective.num_items(batch)  # a dp share's losses divide by the global count
        engine.step(local, num_items=items)  # warm-up (allocator, first uploads)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # On CPU the activations are host memory: the growth of RSS over the timed steps.
        rss_resets, rss_before = reset_peak_rss(), rss_bytes()
        samples = []
        for _ in range(self.args.steps):
            synchronize(self.device)
            start = time.perf_counter()
            engine.step(local, num_items=items)
            synchronize(self.device)
            samples.append(time.perf_counter() - start)
        timer = Timer(samples)
        metrics = {
            "tokens_per_s": tokens / timer.median,
            "host_rss_gb": peak_rss_bytes() / 1e9,
            # uploaded by this rank (offloaded alike)
            "link_gb_per_step": engine.link_bytes_per_step / 1e9,
            "state_host_gb": engine.state_host_bytes / 1e9,
        }
        if rss_resets and rss_before is not None:
            metrics["step_extra_rss_gb"] = (peak_rss_bytes() - rss_before) / 1e9
        if self.device.type == "cuda":
            metrics["peak_device_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        metrics.update(block_phases(engine, local, num_items=items))
        params = {
            "shape": self.args.shape,
            "layers": self.config.num_hidden_layers,
            "batch": point[0],
            "seq": point[1],
            "mode": engine.config.mode,
            "slots": engine.config.num_slots,
            "dp": parallel.dims.dp,
            "pert": parallel.dims.pert,
            "compute": self.compute,
            "threads": torch.get_num_threads(),
            "queries": engine.config.num_queries,
            "peft": self.args.peft,
            "dual_forward": self.args.dual_forward,
            "grad_accum": engine.config.grad_accum,
            "micro_batch_rows": engine.config.micro_batch_rows,
            "optimizer": engine.config.optimizer,
            "state_dtype": engine.config.state_dtype,
        }
        return Measurement.from_timer(name, params, timer, metrics)

    def ratio_key(self, name: str, point: tuple[int, int]) -> str:
        """``offload_vs_resident`` for one point, ``offload_vs_resident[8x512]`` in a sweep."""
        return name if len(self.points) == 1 else f"{name}[{point_name(*point)}]"

    def derive_against_resident(self, resident: dict, layouts: dict[str, dict]) -> None:
        for name, runs in layouts.items():
            for point, m in runs.items():
                ratio = m.metrics["tokens_per_s"] / resident[point].metrics["tokens_per_s"]
                self.report.derived[self.ratio_key(f"{name}_vs_resident", point)] = ratio
        # The crossover: the fewest tokens per step from which on (every larger point too)
        # offload keeps up with resident.
        ordered = sorted(layouts["offload"].items(), key=lambda item: item[0][0] * item[0][1])
        crossover = None
        for (b, s), m in reversed(ordered):
            if m.metrics["tokens_per_s"] < CROSSOVER * resident[(b, s)].metrics["tokens_per_s"]:
                break
            crossover = b * s
        if len(self.points) > 1 and crossover is not None:
            self.report.derived["crossover_tokens_per_step"] = float(crossover)
            logger.info(
                "offload >= %.2f x resident from %d tokens per step on", CROSSOVER, crossover
            )

    def derive_against(self, base: dict, runs: dict, ratios: dict[str, str]) -> None:
        """``derived[name] = metric of runs / metric of base`` at every point, for each
        ``name: metric`` the base has and is not 0 at (peak RSS is not measurable
        everywhere, and a small step's RSS may not grow at all: no ratio to give)."""
        for point, m in runs.items():
            for name, metric in ratios.items():
                if base[point].metrics.get(metric):
                    self.report.derived[self.ratio_key(name, point)] = (
                        m.metrics[metric] / base[point].metrics[metric]
                    )

    def compare_micro_batches(
        self, offload: dict, label: str, grad_accum: int = 1, micro_batch_rows: int = 0
    ) -> None:
        """Offload in micro-batches against the whole batch at once: tokens/s and the peak
        memory of the step (the device's on CUDA, RSS growth on CPU). A bound on the rows
        splits only a batch of more rows: the points it leaves whole are not run again."""
        points = [p for p in self.points if micro_batch_rows < 1 or p[0] > micro_batch_rows]
        runs = self.measure(
            f"offload_{label}",
            "offload",
            self.args.slots,
            ParallelContext.single(),
            self.env.rank == 0,
            grad_accum=grad_accum,
            micro_batch_rows=micro_batch_rows,
            points=points,
        )
        memory = "peak_device_gb" if self.device.type == "cuda" else "step_extra_rss_gb"
        self.derive_against(
            offload,
            runs,
            {f"{label}_vs_offload": "tokens_per_s", f"{label}_peak_memory_vs_offload": memory},
        )

    def run(self) -> BenchReport:
        single = ParallelContext.single()
        first = self.env.rank == 0
        resident = {}
        if not self.args.skip_resident:
            resident = self.measure("resident", "resident", 1, single, first)
        serial = self.measure("offload_serial", "offload", 1, single, first)
        two = (
            self.measure("offload_2slots", "offload", 2, single, first)
            if self.args.slots != 2
            else {}
        )
        offload = self.measure("offload", "offload", self.args.slots, single, first)
        if first and resident:
            layouts = {"offload_serial": serial, "offload": offload} | (
                {"offload_2slots": two} if two else {}
            )
            self.derive_against_resident(resident, layouts)
        if first and two:  # the slot count, side by side: K slots against 2 at every point
            for point, m in offload.items():
                ratio = m.metrics["tokens_per_s"] / two[point].metrics["tokens_per_s"]
                self.report.derived[self.ratio_key("offload_vs_2slots", point)] = ratio
        # micro-batches per step: the same step, less activation memory; a count
        # (--grad-accum) or a bound on each one's rows (--micro-batch-rows)
        for n in self.args.grad_accum:
            if n > 1:
                self.compare_micro_batches(offload, f"accum{n}", grad_accum=n)
        for n in self.args.micro_batch_rows:
            self.compare_micro_batches(offload, f"rows{n}", micro_batch_rows=n)
        for (
            optimizer
        ) in self.args.optimizers:  # stored moments ride with every block: more bytes per step
            if optimizer != "sgd":
                runs = self.measure(
                    f"offload_{optimizer}",
                    "offload",
                    self.args.slots,
                    single,
                    first,
                    optimizer=optimizer,
                )
                self.derive_against(
                    offload,
                    runs,
                    {
                        f"{optimizer}_vs_sgd": "tokens_per_s",
                        f"{optimizer}_link_bytes_vs_sgd": "link_gb_per_step",
                    },
                )
        world = self.env.world_size
        if world > 1:
            # Every layout spans the whole world (its all-reduce does): PertP on 2 ranks,
            # 2D (dp x 2) on more, DDP on any.
            world_layouts = {"ddp": ParallelDims(world, 1)}
            if world == 2:
                world_layouts["pertp"] = ParallelDims(1, 2)
            elif world % 2 == 0:
                world_layouts["2d"] = ParallelDims(world // 2, 2)
            for name, dims in world_layouts.items():
                for batch, _ in self.points:
                    dims.check_batch(batch)
                runs = self.measure(
                    name, "offload", self.args.slots, ParallelContext(self.env, dims)
                )
                if first:
                    for point, m in runs.items():
                        ratio = m.metrics["tokens_per_s"] / offload[point].metrics["tokens_per_s"]
                        self.report.derived[self.ratio_key(f"{name}_vs_1_rank", point)] = ratio
        return self.report


def interleaved_steps(
    engines: dict[str, ZOEngine], batch: dict, steps: int, device: torch.device
) -> dict[str, tuple[Timer, int | None]]:
    """Each engine's step times, the engines' steps taken in turn so that drift on a noisy
    machine hits them alike, and the most memory one of its steps took above what was in
    use before it (device memory on CUDA, RSS on CPU; None where it cannot be measured)."""
    samples: dict[str, list[float]] = {name: [] for name in engines}
    extra: dict[str, int | None] = {name: None for name in engines}
    before: int | None
    for engine in engines.values():
        engine.step(batch)  # warm-up (allocator, first uploads)
    for _ in range(steps):
        for name, engine in engines.items():
            synchronize(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                before, resets = torch.cuda.memory_allocated(device), True
            else:
                resets, before = reset_peak_rss(), rss_bytes()
            start = time.perf_counter()
            engine.step(batch)
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
            peak = (
                torch.cuda.max_memory_allocated(device)
                if device.type == "cuda"
                else peak_rss_bytes()
            )
            if resets and before is not None:
                extra[name] = max(extra[name] or 0, peak - before)
    return {name: (Timer(samples[name]), extra[name]) for name in engines}


# P-RGE's layouts at the same query count: (adapter, dual forward, batched queries).
ADAPTER_LAYOUTS = {
    "full": ("none", False, False),
    "lora_fa": ("lora-fa", False, False),
    "lora_fa_dual": ("lora-fa", True, False),
    "lora_fa_queries": ("lora-fa", False, True),
    "lora_fa_dual_queries": ("lora-fa", True, True),
}


class AdapterBench:
    """Full tuning vs LoRA-FA vs LoRA-FA with P-RGE's batched passes (the dual forward, the
    batched queries, both), every layout at the same ``--num-queries``, steps interleaved.

    Every layout does the same arithmetic per step (2q forward passes over the batch); what
    differs is how the passes are grouped. A group of g passes reads each base weight once
    for g copies of the batch, so it pays where reading the weights is the step's cost
    (small batches, a memory-bound device) and gives nothing where the matrix products
    already saturate the device."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.report = BenchReport("throughput", device_name(device), 1)
        self.config = model_config(args.shape, args.layers, max(seq for _, seq in args.points))

    def engine(self, peft: str, dual_forward: bool, batch_queries: bool) -> ZOEngine:
        config = ZOConfig(
            lr=1e-7,
            eps=1e-3,
            seed=0,
            device=str(self.device),
            mode=self.args.mode,
            compute_dtype=self.args.compute_dtype,
            transfer="naive" if self.args.mode == "offload" else "auto",
            num_queries=self.args.num_queries,
            dual_forward=dual_forward,
            batch_queries=batch_queries,
            lr_schedule="constant",
        )
        model = skeleton(self.config, torch.float32)
        weights: WeightSource = random_weights(self.device)
        if peft != "none":
            model = attach_adapter(model, AdapterSpec(peft), seed=0)
            weights = AdapterWeights(weights, model)
        return ZOEngine(model, config, weights=weights)

    def run(self) -> BenchReport:
        engines = {name: self.engine(*layout) for name, layout in ADAPTER_LAYOUTS.items()}
        g = torch.Generator().manual_seed(0)
        for b, s in self.args.points:
            batch = {"input_ids": torch.randint(3, self.config.vocab_size, (b, s), generator=g)}
            steps = interleaved_steps(engines, batch, self.args.steps, self.device)
            speed = {}
            for name, (timer, extra) in steps.items():
                peft, dual, queries = ADAPTER_LAYOUTS[name]
                params = {
                    "shape": self.args.shape,
                    "layers": self.config.num_hidden_layers,
                    "batch": b,
                    "seq": s,
                    "mode": self.args.mode,
                    "compute": self.args.compute_dtype,
                    "threads": torch.get_num_threads(),
                    "queries": self.args.num_queries,
                    "peft": peft,
                    "dual_forward": dual,
                    "batch_queries": queries,
                    "trained_params": engines[name].num_parameters,
                }
                metrics = {"tokens_per_s": b * s / timer.median}
                if extra is not None:
                    metrics["step_extra_memory_gb"] = extra / 1e9
                self.report.measurements.append(
                    Measurement.from_timer(name, params, timer, metrics)
                )
                speed[name] = metrics["tokens_per_s"]
                logger.info("%-21s %-9s %10.1f tokens/s", name, point_name(b, s), speed[name])
            key = f"[{point_name(b, s)}]"
            self.report.derived["lora_fa_vs_full" + key] = speed["lora_fa"] / speed["full"]
            for name in ("lora_fa_dual", "lora_fa_queries", "lora_fa_dual_queries"):
                self.report.derived[f"{name.removeprefix('lora_fa_')}_vs_lora_fa{key}"] = (
                    speed[name] / speed["lora_fa"]
                )
        return self.report


def sst2_shaped(examples: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Classification batch shaped like SST-2 prompts: 8-48 tokens, two one-token candidates."""
    g = torch.Generator().manual_seed(seed)
    encodings = []
    for e in range(examples):
        length = int(torch.randint(8, 49, (1,), generator=g))
        prompt = tuple(torch.randint(3, vocab, (length,), generator=g).tolist())
        scored = ((0, length - 1, 5, 0), (0, length - 1, 6, 1))
        encodings.append(ChoiceEncoding((prompt,), scored, e % 2))
    return collate_choices(encodings, pad_id=0)


class HeadBench:
    """The LM head at label positions vs on every position: step time and evaluation memory."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.report = BenchReport("throughput", device_name(device), 1)
        self.config = model_config(args.shape, args.layers, 64)

    def engine(self, full_head: bool) -> ZOEngine:
        config = ZOConfig(
            lr=1e-7,
            eps=1e-3,
            seed=0,
            device=str(self.device),
            mode=self.args.mode,
            compute_dtype=self.args.compute_dtype,
            lr_schedule="constant",
        )
        model = skeleton(self.config, torch.float32)
        return ZOEngine(
            model,
            config,
            weights=random_weights(self.device),
            objective=Classification(full_head=full_head),
        )

    def params(self, head: str, batch: int) -> dict:
        return {
            "shape": self.args.shape,
            "layers": self.config.num_hidden_layers,
            "head": head,
            "batch": batch,
            "mode": self.args.mode,
            "compute": self.args.compute_dtype,
            "threads": torch.get_num_threads(),
        }

    def step_times(self, engines: dict[str, ZOEngine], batch: dict) -> dict[str, Measurement]:
        """Steps of the two engines interleaved, so drift on a noisy machine hits both alike."""
        steps = interleaved_steps(engines, batch, self.args.steps, self.device)
        tokens = int(batch["attention_mask"].sum())
        return {
            name: Measurement.from_timer(
                f"step_{name}",
                self.params(name, batch["label"].shape[0]),
                timer,
                {"tokens_per_s": tokens / timer.median},
            )
            for name, (timer, _) in steps.items()
        }

    def eval_peak(self, engine: ZOEngine, batch: dict, old_way: bool) -> tuple[float, float]:
        """(seconds, peak bytes above the memory in use before) of one evaluation call."""
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        else:
            reset_peak_rss()
            base = rss_bytes() or 0
        start = time.perf_counter()
        if old_way:  # what evaluation did before: every logit, a float32 log-softmax of all of them
            logits, _ = engine.forward(
                {k: batch[k].flatten(0, 1) for k in ("input_ids", "attention_mask")}
            )
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            rows = torch.arange(logits.shape[0])
            last = batch["attention_mask"].flatten(0, 1).sum(1) - 1
            best = log_probs[rows, last][:, [5, 6]].argmax(1)
        else:
            prepared = prepare_choices(batch, engine.device)

            def scores(runner):
                hidden = runner.hidden_states(
                    {UNPERTURBED: prepared.input_ids}, prepared.attention_mask
                )[UNPERTURBED]
                return candidate_scores(runner, prepared, UNPERTURBED, hidden)

            best = engine.evaluate(scores).argmax(1)
        best.cpu()
        elapsed = time.perf_counter() - start
        peak = (
            torch.cuda.max_memory_allocated(self.device)
            if self.device.type == "cuda"
            else peak_rss_bytes()
        )
        return elapsed, float(peak - base)

    def run(self) -> BenchReport:
        vocab = self.config.vocab_size
        engines = {"at_labels": self.engine(False), "full": self.engine(True)}
        steps = self.step_times(engines, sst2_shaped(self.args.batch, vocab, seed=1))
        self.report.measurements += steps.values()
        self.report.derived["step_full_over_at_labels"] = (
            steps["full"].median_s / steps["at_labels"].median_s
        )
        for name, m in steps.items():
            logger.info("step, head %-9s %8.1f ms", name, m.median_s * 1e3)
        evaluation = sst2_shaped(self.args.eval_batch, vocab, seed=2)
        engine = engines["at_labels"]
        for old_way, name in ((True, "full"), (False, "at_labels")):
            # warm-up: the allocator's first growth is not the method's
            self.eval_peak(engine, evaluation, old_way)
            seconds, extra = self.eval_peak(engine, evaluation, old_way)
            self.report.measurements.append(
                Measurement(
                    f"eval_{name}",
                    self.params(name, self.args.eval_batch),
                    1,
                    seconds,
                    seconds,
                    seconds,
                    0.0,
                    {"eval_peak_extra_gb": extra / 1e9},
                )
            )
            self.report.derived[f"eval_peak_extra_gb[{name}]"] = extra / 1e9
            logger.info(
                "evaluation of %d rows, head %-9s %6.3f s, peak +%.3f GB",
                self.args.eval_batch,
                name,
                seconds,
                extra / 1e9,
            )
        return self.report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, its defaults settled by the kind of comparison (``--quick``,
    ``--compare-head``, ``--compare-adapters``) and refused in one line where they clash."""
    return settle(build_parser().parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    """The command line alone: gpu_session.sh's flags are checked against it without a GPU."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 2 steps: seconds (CI)")
    p.add_argument(
        "--shape",
        default=None,
        choices=SHAPE_NAMES,
        help="model shape (default tiny if --quick, else opt-1.3b)",
    )
    p.add_argument(
        "--layers", type=at_least(1), default=None, help="override the layer count (memory)"
    )
    p.add_argument(
        "--batch", type=at_least(1), default=None, help="global batch (default 8; quick 4)"
    )
    p.add_argument(
        "--seq", type=at_least(2), default=None, help="sequence length (default 512; quick 32)"
    )
    p.add_argument(
        "--sweep", default=None, help="batch x seq points instead, e.g. 1x128,4x512,16x512"
    )
    p.add_argument(
        "--steps",
        type=at_least(1),
        default=None,
        help="timed steps per layout (default 5; quick 2)",
    )
    p.add_argument(
        "--slots",
        type=at_least(1),
        default=3,
        help="device slots of the overlapped offload "
        "(default 3, the engine's; 2 is measured beside it)",
    )
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument(
        "--num-queries",
        type=at_least(1),
        default=None,
        help="directions per step (n-SPSA): 2 passes each per uploaded block, "
        "so transfers weigh less (default 1; 4 with --compare-adapters)",
    )
    p.add_argument(
        "--grad-accum",
        type=counts(1),
        default="1",
        help="micro-batches per step to compare, e.g. 1,2,4: offload at each "
        "(one upload per block per step), tokens/s and peak memory against the whole batch "
        "at once",
    )
    p.add_argument(
        "--micro-batch-rows",
        type=counts(1),
        default="",
        help="bounds on a micro-batch's rows to compare, e.g. 4,2 (--micro-batch-rows of "
        "distzo.train): offload at each, tokens/s and peak memory against the whole batch "
        "at once (default: none)",
    )
    p.add_argument(
        "--optimizers",
        default="sgd",
        help="optimizers to compare offloaded, e.g. sgd,momentum,adam: momentum and adam "
        "store their moments beside each block and move them with it "
        "(tokens/s and link bytes against sgd)",
    )
    p.add_argument(
        "--state-dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="--optimizers: the stored moments' format at rest and on the link",
    )
    p.add_argument(
        "--threads",
        type=at_least(1),
        default=1,
        help="CPU threads per rank (the same for every layout)",
    )
    p.add_argument(
        "--skip-resident", action="store_true", help="when the model does not fit the device"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="benchmarks/out/throughput.json")
    add_comparison_arguments(p)
    return p


def add_comparison_arguments(p: argparse.ArgumentParser) -> None:
    """The adapter options (a run with --peft, and --compare-adapters' layouts) and the two
    comparisons' own."""
    p.add_argument(
        "--peft",
        default="none",
        choices=["none", "lora", "lora-fa", "prefix"],
        help="train an adapter: the base is uploaded only (no offload), "
        "the adapter stays on the device",
    )
    p.add_argument(
        "--dual-forward",
        action="store_true",
        help="with --peft: both signs of a query in one forward",
    )
    p.add_argument(
        "--compare-adapters",
        action="store_true",
        help="full tuning vs LoRA-FA vs LoRA-FA with --dual-forward, --batch-queries and both, at "
        "--num-queries (default 4), every point of --sweep or --batch x --seq",
    )
    p.add_argument(
        "--compare-head",
        action="store_true",
        help="the LM head at label positions vs the full head on an SST-2-shaped batch "
        "(default shape smollm2-135m, batch 16, evaluation batch 64)",
    )
    p.add_argument(
        "--eval-batch",
        type=at_least(1),
        default=None,
        help="--compare-head: evaluation rows (default 64; quick 8)",
    )
    p.add_argument(
        "--mode",
        default="resident",
        choices=["resident", "offload"],
        help="--compare-head, --compare-adapters: engine mode",
    )


def settle(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on the comparison and check the counts."""
    if args.compare_head:
        args.shape = args.shape or ("tiny" if args.quick else "smollm2-135m")
        args.batch = args.batch or (4 if args.quick else 16)
        args.eval_batch = args.eval_batch or (8 if args.quick else 64)
    args.shape = args.shape or ("tiny" if args.quick else "opt-1.3b")
    args.batch = args.batch or (4 if args.quick else 8)
    args.seq = args.seq or (32 if args.quick else 512)
    args.steps = args.steps or (2 if args.quick else 5)
    args.points = parse_points(args.sweep) if args.sweep else [(args.batch, args.seq)]
    args.num_queries = args.num_queries or (4 if args.compare_adapters else 1)
    if args.compare_adapters and (args.compare_head or args.peft != "none" or args.dual_forward):
        raise SystemExit(
            "--compare-adapters runs its own layouts: leave out --compare-head, --peft and "
            "--dual-forward"
        )
    args.optimizers = args.optimizers.split(",")
    if not set(args.optimizers) <= {"sgd", "momentum", "adam"}:
        raise SystemExit(
            "--optimizers takes sgd, momentum, adam, comma-separated, got "
            f"{','.join(args.optimizers)}"
        )
    if any(n > b for n in args.grad_accum for b, _ in args.points):
        raise SystemExit(f"--grad-accum counts must be at most the batch, got {args.grad_accum}")
    return args


def open_device(args: argparse.Namespace, env: LaunchEnv) -> torch.device:
    """This rank's device (its GPU, or the CPU at ``--threads`` threads), logging set up
    for rank 0 and the process group joined under torchrun."""
    logging.basicConfig(
        level=logging.INFO if env.rank == 0 else logging.WARNING, format="%(message)s"
    )
    logging.getLogger("distzo").setLevel(logging.WARNING)
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device(
        f"cuda:{env.local_rank}"
        if args.device == "auto" and cuda
        else ("cpu" if not cuda else args.device)
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.threads)
        return_large_blocks()
    if env.launched:
        pg.init_process_group(env, pg.resolve_backend("auto", device), timeout_s=1800)
    return device


def report_columns(args: argparse.Namespace) -> list[str]:
    """The Markdown table's columns of the comparison run."""
    if args.compare_head:
        return ["head", "mode", "batch", "tokens_per_s", "eval_peak_extra_gb"]
    if args.compare_adapters:
        return [
            "peft",
            "dual_forward",
            "batch_queries",
            "queries",
            "batch",
            "seq",
            "tokens_per_s",
            "step_extra_memory_gb",
        ]
    return [
        "mode",
        "slots",
        "dp",
        "pert",
        "queries",
        "grad_accum",
        "micro_batch_rows",
        "batch",
        "seq",
        "tokens_per_s",
        "peak_device_gb",
        "step_extra_rss_gb",
        "eta",
    ]


def main() -> None:
    args = parse_args()
    env = LaunchEnv.from_environ()
    if (args.compare_head or args.compare_adapters) and env.world_size > 1:
        raise SystemExit(
            "--compare-head and --compare-adapters run in one process; "
            "launch them with python, not torchrun"
        )
    device = open_device(args, env)
    if args.compare_head:
        report = HeadBench(args, device).run()
    elif args.compare_adapters:
        report = AdapterBench(args, device).run()
    else:
        report = Bench(args, env, device).run()
    if env.rank == 0:
        out = Path(args.out)
        columns = report_columns(args)
        report.write(out, columns)
        logger.info("wrote %s, %s", out, out.with_suffix(".md"))
    pg.shutdown()


if __name__ == "__main__":
    main()
