"""``python -m distzo.train``: ZO fine-tuning from the command line.

With no arguments it trains a tiny random-init OPT on a counting task generated in
code (no download), evaluates before and after, and prints the loss going down.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
import time

import torch
from tqdm import tqdm

from distzo.config import MODES, ZOConfig
from distzo.data import CountingTask
from distzo.engine import ZOEngine
from distzo.models import load_model, model_from_config
from distzo.models.tiny import tiny_opt_config
from distzo.zo import SCHEDULES

logger = logging.getLogger("distzo.train")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m distzo.train",
        description="Zeroth-order (MeZO / ZO2) fine-tuning. Defaults train a tiny OPT on a generated counting task.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="hub name or local path of an OPT model; default: tiny random init")
    p.add_argument("--max-steps", type=int, default=2000, help="ZO steps to take")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per generated sequence")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate")
    p.add_argument("--eps", type=float, default=1e-3, help="perturbation scale")
    p.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay on matrices")
    p.add_argument("--lr-schedule", choices=SCHEDULES, default="linear", help="learning-rate schedule")
    p.add_argument("--mode", choices=MODES, default="offload", help="offload: blocks in host memory (ZO2); resident: all on device (MeZO)")
    p.add_argument("--num-slots", type=int, default=2, help="device slots for streamed blocks (1 = no overlap)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0, help="run seed (model init, data and noise); -1 draws one at random")
    p.add_argument("--eval-batch-size", type=int, default=64, help="sequences in the fixed evaluation batch")
    p.add_argument("--log-every", type=int, default=50, help="log a line every N steps")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    seed = secrets.randbits(31) if args.seed == -1 else args.seed
    try:
        if args.max_steps < 0 or args.batch_size < 1 or args.eval_batch_size < 1:
            raise ValueError("--max-steps must be >= 0 and --batch-size/--eval-batch-size >= 1")
        config = ZOConfig(
            lr=args.lr,
            eps=args.eps,
            weight_decay=args.weight_decay,
            lr_schedule=args.lr_schedule,
            max_steps=args.max_steps,
            mode=args.mode,
            num_slots=args.num_slots,
            device=args.device,
            seed=seed,
        )
        torch.manual_seed(seed)  # the random init of the default model
        model = load_model(args.model) if args.model else model_from_config(tiny_opt_config())
        if args.seq_len > model.config.max_position_embeddings:
            raise ValueError(
                f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings "
                f"{model.config.max_position_embeddings}; lower --seq-len"
            )
        task = CountingTask(model.config.vocab_size, seq_len=args.seq_len, seed=seed)
        engine = ZOEngine(model, config)
    except OSError as err:  # a missing or unreadable --model
        print(f"error: cannot load --model {args.model!r}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    logger.info("run seed %d", seed)
    eval_batch = task.batch(args.eval_batch_size)
    before = engine.forward(eval_batch | {"labels": eval_batch["input_ids"]})[1].item()
    logger.info("eval loss before training: %.4f", before)
    start, tokens = time.perf_counter(), 0
    progress = tqdm(range(args.max_steps), desc="train", disable=None)
    for step in progress:
        result = engine.step(task.batch(args.batch_size))
        tokens += result.num_tokens
        progress.set_postfix(loss=f"{result.loss:.4f}", g=f"{result.projected_grad:+.3g}")
        if args.log_every and (step % args.log_every == 0 or step == args.max_steps - 1):
            logger.info("step %d loss %.4f g %+.4g lr %.3g", step, result.loss, result.projected_grad, result.lr)
    elapsed = time.perf_counter() - start
    after = engine.forward(eval_batch | {"labels": eval_batch["input_ids"]})[1].item()
    logger.info(
        "eval loss %.4f -> %.4f after %d steps (%.1f s, %.0f tokens/s)",
        before,
        after,
        args.max_steps,
        elapsed,
        tokens / max(elapsed, 1e-9),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
