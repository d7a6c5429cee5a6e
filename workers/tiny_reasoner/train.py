"""Trains the tiny-reasoner from scratch: a small ``LlamaForCausalLM`` on the task family of
``tasks.py``, loss on the completion only, saved in Hugging Face format.

    python -m thinkserve.workers.tiny_reasoner.train --out DIR [--seed 0] [--steps 2400] [--minutes 60]

Two stages in one command. Stage 1 trains from scratch with plain cross-entropy (AdamW, cosine
schedule over ``--steps``). Stage 2 (``--calibrate-steps``, default 300) continues at a small
constant LR with *digit smoothing*: a digit target keeps 1 - epsilon of the probability and
spreads epsilon over the ten digits. Stage 1 alone yields a model so sharp that sampling at
temperature 1.0 reproduces greedy decoding; stage 2 gives every digit a small, fixed chance
of a slip when sampling, so long chains fail more often than short ones, greedy stays exact,
and Best-of-N voting recovers the answer, as with real reasoning models.

Deterministic under ``--seed`` on one device and thread count: the data streams come from
seeded ``random.Random`` instances, the weights from ``torch.manual_seed``, and torch runs its
deterministic kernels. ``--steps`` fixes the learning-rate schedule; ``--minutes`` is only a
wall-clock guard (training stops early, with a warning; ``training_meta.json`` records the
completed steps, and ``--stop-at-step`` replays exactly such a cut-short run). ``--init-from
DIR`` skips stage 1 and calibrates the weights in DIR. A checkpoint is written to ``--out``
every ``--save-every-minutes`` so a usable model exists early. Uses CUDA when present (fp32 there
too; ``--cpu`` forces the CPU path).

Batches are rows of 1,536 tokens filled with *whole* problems (no problem is cut); the gap a
long problem leaves is filled with short ones, the rest padded. Padding and prompts carry no
loss. Levels are drawn with ``LEVEL_WEIGHTS``: the short levels, which cost few tokens, get many
draws, most tokens still go to long chains, and "prefix drills" (a Collatz prompt and only the
first two chain lines) exercise the one step that reads the prompt.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# On a shared, oversubscribed CPU, spinning OpenMP workers waste most of the cycles: sleep instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from . import tasks
from .tokenizer_build import BOS, EOS, PAD, VOCAB_SIZE, build_tokenizer, token_id, write_tokenizer_files

# Pseudo-level 0: a Collatz prompt and only the first two chain lines (no EOS). Line 0 copies
# the prompt's number reversed, the one step that looks back at the prompt; a whole problem
# teaches it once per ~100 lines, these drills teach it in 30 tokens.
PREFIX_LEVEL = 0

# Problems drawn per level (relative). Short levels are cheap, so they get more draws.
LEVEL_WEIGHTS: dict[int, float] = {0: 24.0, 1: 2.0, 2: 4.0, 3: 16.0, 4: 1.0, 5: 1.0, 6: 1.0, 7: 1.0, 8: 1.0, 9: 1.0}

# Short problems that fill the end of a row a long problem did not fit into.
FILLER_WEIGHTS: dict[int, float] = {0: 6.0, 1: 1.0, 2: 2.0, 3: 4.0, 4: 2.0, 5: 2.0}

IGNORE = -100
DIGIT_IDS = tuple(token_id(str(d)) for d in range(10))


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 192
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 6
    max_position_embeddings: int = 1536


def llama_config(shape: ModelShape):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        head_dim=shape.hidden_size // shape.num_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,  # two matrices: every loader reads them without special-casing
        bos_token_id=token_id(BOS),
        eos_token_id=token_id(EOS),
        pad_token_id=token_id(PAD),
        architectures=["LlamaForCausalLM"],
    )


# ---------------------------------------------------------------- data


class ProblemStream:
    """An endless, seeded stream of tokenized training problems: (ids, labels)."""

    def __init__(self, seed: int, context: int, weights: dict[int, float] = LEVEL_WEIGHTS, name: str = "train"):
        self.rng = random.Random(f"tiny-reasoner/{name}/{seed}")
        self.tok = build_tokenizer()
        self.context = context
        self.levels, self.weights = zip(*sorted(weights.items()))

    def next(self) -> tuple[list[int], list[int]]:
        level = self.rng.choices(self.levels, self.weights)[0]
        if level == PREFIX_LEVEL:
            problem, eos = self._prefix_problem(), []
            n = problem.operands[0]
            text = tasks.THINK_START + tasks.collatz_line(0, ":", n)  # the chain's first two lines
            if n != 1:
                text += tasks.collatz_line(1, "/", n // 2) if n % 2 == 0 else tasks.collatz_line(1, "*", 3 * n + 1)
        else:
            problem, eos = tasks.sample_problem(level, self.rng, split="train"), [token_id(EOS)]
            text = tasks.solution_for(problem)
        prompt = self.tok.encode(tasks.prompt_for(problem)).ids  # starts with <s>
        completion = self.tok.encode(text, add_special_tokens=False).ids + eos
        ids = prompt + completion
        assert len(ids) <= self.context, (len(ids), problem)
        return ids, [IGNORE] * len(prompt) + completion


    def _prefix_problem(self) -> tasks.Problem:
        """A Collatz start of 1-5 digits (uniform over the digit count), any step count."""
        while True:
            digits = self.rng.randint(1, 5)
            n = self.rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
            if tasks.in_split((n,), "train"):
                return tasks.Problem(PREFIX_LEVEL, "collatz", (n,), -1)  # the answer is never written


class RowPacker:
    """Fills rows of ``context`` tokens with whole problems. A problem that does not fit the
    current row starts the next one; the gap is filled with short problems (levels 1-5) from a
    second seeded stream, and what is left is padding, ignored by the loss."""

    def __init__(self, stream: ProblemStream, context: int, filler: ProblemStream | None = None):
        self.stream, self.context, self.filler = stream, context, filler
        self.pending: tuple[list[int], list[int]] | None = None

    def row(self) -> tuple[list[int], list[int], int]:
        ids: list[int] = []
        labels: list[int] = []
        while True:
            doc = self.pending or self.stream.next()
            self.pending = None
            if len(ids) + len(doc[0]) > self.context:
                self.pending = doc
                break
            ids += doc[0]
            labels += doc[1]
        misses = 0
        while self.filler is not None and misses < 3 and self.context - len(ids) >= 16:
            doc = self.filler.next()
            if len(ids) + len(doc[0]) > self.context:
                misses += 1
                continue
            ids += doc[0]
            labels += doc[1]
        used = len(ids)
        pad = self.context - used
        return ids + [token_id(PAD)] * pad, labels + [IGNORE] * pad, used

    def batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        out = [self.row() for _ in range(rows)]
        ids = torch.tensor([r[0] for r in out], dtype=torch.long)
        labels = torch.tensor([r[1] for r in out], dtype=torch.long)
        return ids, labels, sum(r[2] for r in out)


# ---------------------------------------------------------------- training


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_model(model, out: Path, meta: dict) -> None:
    """config.json, model.safetensors (fp32), generation_config.json, tokenizer files."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".saving"
    tmp.mkdir(exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    gen = GenerationConfig(
        bos_token_id=token_id(BOS), eos_token_id=token_id(EOS), pad_token_id=token_id(PAD),
        do_sample=False, max_new_tokens=1536,
    )
    gen.save_pretrained(tmp)
    write_tokenizer_files(tmp)
    (tmp / "training_meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    for f in tmp.iterdir():
        os.replace(f, out / f.name)  # each file lands whole: a reader never sees a torn checkpoint
    tmp.rmdir()


def digit_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Next-token cross-entropy where a *digit* target keeps 1 - epsilon and spreads epsilon
    evenly over the ten digits; other targets are plain one-hot. Positions labelled IGNORE
    carry no loss."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    keep = labels != IGNORE
    logp = torch.log_softmax(logits[keep], dim=-1)
    target = labels[keep]
    nll = -logp.gather(1, target[:, None])[:, 0]
    digits = torch.tensor(DIGIT_IDS, device=logits.device)
    is_digit = torch.isin(target, digits)
    spread = -logp[:, digits].mean(dim=1)
    per_token = torch.where(is_digit, (1 - epsilon) * nll + epsilon * spread, nll)
    return per_token.mean()


def _optimizer(model, lr: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.98), eps=1e-8,
    )


def _run_stage(name, model, packer, *, steps, rows, lr_fn, loss_fn, device, args, out, meta, start, stop_at=None) -> tuple[int, int]:
    """One training loop; returns (steps done, tokens seen). Checkpoints to ``out`` on a timer."""
    opt = _optimizer(model, lr_fn(0))
    last_save = last_log = time.time()
    tokens = tokens_since_log = 0
    loss_ema = None
    model.train()
    done = 0  # optimizer steps completed
    for step in range(steps):
        if stop_at is not None and step >= stop_at:
            print(f"[{name}] --stop-at-step {stop_at} reached; stopping (schedule set by {steps} steps)", flush=True)
            break
        if time.time() - start > args.minutes * 60:
            print(f"WARNING: [{name}] --minutes {args.minutes} reached at step {step}/{steps}; stopping early", flush=True)
            break
        lr = lr_fn(step)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, labels, used = packer.batch(rows)
        ids, labels = ids.to(device), labels.to(device)
        loss = loss_fn(model, ids, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done += 1
        tokens += used
        tokens_since_log += used
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        now = time.time()
        if step % args.log_every == 0 or step == steps - 1:
            print(
                f"[{name}] step {step:5d}/{steps} loss {loss.item():.4f} (ema {loss_ema:.4f}) lr {lr:.2e} "
                f"tok/s {tokens_since_log / max(1e-9, now - last_log):7.0f} tokens {tokens / 1e6:.2f}M "
                f"elapsed {(now - start) / 60:5.1f}min",
                flush=True,
            )
            last_log, tokens_since_log = now, 0
        if now - last_save > args.save_every_minutes * 60:
            save_model(model, out, {**meta, f"{name}_completed_steps": done, "final": False})
            last_save = now
            print(f"checkpoint saved to {out} at {name} step {done}", flush=True)
    return done, tokens


def train(args: argparse.Namespace) -> Path:
    """Stage 1 ("train"): from scratch, plain cross-entropy, cosine schedule over ``--steps``.
    Stage 2 ("calibrate"): ``--calibrate-steps`` at a small constant LR with digit-smoothed
    loss, so the model keeps a small, fixed probability on wrong digits (see README: without
    it sampling at T=1.0 equals greedy decoding and Best-of-N voting cannot matter).
    ``--init-from DIR`` skips stage 1 and calibrates the weights in DIR."""
    from transformers import LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    shape = ModelShape()
    context = shape.max_position_embeddings
    if args.init_from:
        model = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32).to(device)
    else:
        model = LlamaForCausalLM(llama_config(shape)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params, {shape}, device={device}", flush=True)
    out = Path(args.out)
    meta = {
        "seed": args.seed, "steps": args.steps, "rows": args.rows, "lr": args.lr, "warmup": args.warmup,
        "calibrate_steps": args.calibrate_steps, "calibrate_lr": args.calibrate_lr,
        "digit_smoothing": args.digit_smoothing, "init_from": args.init_from,
        "context": context, "level_weights": LEVEL_WEIGHTS, "filler_weights": FILLER_WEIGHTS, "params": n_params,
        "command": "python -m thinkserve.workers.tiny_reasoner.train " + " ".join(sys.argv[1:]),
    }
    start = time.time()
    tokens = 0

    def plain_loss(m, ids, labels):
        return m(input_ids=ids, labels=labels).loss

    if not args.init_from:
        packer = RowPacker(ProblemStream(args.seed, context), context, ProblemStream(args.seed, context, FILLER_WEIGHTS, name="filler"))
        done, seen = _run_stage("train", model, packer, steps=args.steps, rows=args.rows,
                                lr_fn=lambda s: lr_at(s, args.steps, args.lr, args.warmup), loss_fn=plain_loss,
                                device=device, args=args, out=out, meta=meta, start=start, stop_at=args.stop_at_step)
        meta["train_completed_steps"], tokens = done, tokens + seen
    if args.calibrate_steps > 0:
        packer = RowPacker(ProblemStream(args.seed, context, name="calibrate"), context,
                           ProblemStream(args.seed, context, FILLER_WEIGHTS, name="calibrate-filler"))
        eps = args.digit_smoothing
        done, seen = _run_stage("calibrate", model, packer, steps=args.calibrate_steps, rows=args.rows,
                                lr_fn=lambda s: args.calibrate_lr * min(1.0, (s + 1) / 20),
                                loss_fn=lambda m, ids, labels: digit_smoothed_loss(m(input_ids=ids).logits, labels, eps),
                                device=device, args=args, out=out, meta=meta, start=start)
        meta["calibrate_completed_steps"], tokens = done, tokens + seen
    meta.update(tokens=tokens, final=True, minutes=round((time.time() - start) / 60, 1))
    save_model(model, out, meta)
    print(f"done: {tokens / 1e6:.1f}M tokens, {(time.time() - start) / 60:.1f} min -> {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (Hugging Face format)")
    p.add_argument("--steps", type=int, default=2400, help="optimizer steps (fixes the LR schedule)")
    p.add_argument("--minutes", type=float, default=60.0, help="wall-clock guard; stops early if reached")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="stop after this many steps, the schedule still set by --steps (replays a run the guard cut short)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibrate-steps", type=int, default=300, help="stage 2 steps (0: skip)")
    p.add_argument("--calibrate-lr", type=float, default=2e-4)
    p.add_argument("--digit-smoothing", type=float, default=6e-4,
                   help="stage 2: probability mass a digit target spreads over the ten digits")
    p.add_argument("--init-from", default=None, help="skip stage 1: calibrate the weights in this directory")
    p.add_argument("--rows", type=int, default=2, help="rows of 1536 tokens per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--cpu", action="store_true", help="train on CPU even when CUDA is present")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--save-every-minutes", type=float, default=5.0)
    train(p.parse_args(argv))


if __name__ == "__main__":
    main()
