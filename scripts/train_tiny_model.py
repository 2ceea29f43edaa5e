"""Train the built-in tiny Qwen3.5-MoE model (sglang_lite/assets/tiny_qwen3_5_moe/) on the Python standard library.

Why: with random weights the built-in model continues every prompt with noise, so demos, README examples and
tests of the serving path show nothing a reader can judge. A few minutes of training on the corpus its tokenizer
was built from (the standard library's source, present on every machine with Python, no download) gives a model
whose completions look like Python and whose held-out loss is a number a test can bound.

How: the corpus is read by scripts/make_tiny_tokenizer.py's iterator (imported, not copied): stdlib files in sorted
order, each capped at 64 KiB, here with a byte cap that takes the whole standard library (about 10 MB; the tokenizer
was trained on the first 6 MB). A run on the 6 MB corpus alone reached a held-out loss of 2.23 but repeated
docstrings when decoding greedily; the whole library gave 2.57 held-out, 2.80 against 3.20 on unseen Python, and
code-like greedy completions. Every HELDOUT_EVERY-th file is held out and never trained on. Each split is tokenised
with the asset tokenizer, documents joined with <|endoftext|>, and cut into fixed windows; the training order is a
seeded permutation of the windows. The model is the transformers reference Qwen3_5MoeForCausalLM built from the
asset config.json (on a CPU transformers uses its pure-PyTorch gated delta rule, which is differentiable). AdamW
with a linear warmup and cosine decay runs a fixed number of steps, so a given seed, step count and Python version
give the same run. The checkpoint is written in bfloat16 with the standard transformers tensor names; config.json
and the tokenizer files are left as they are.

Run from the repository root:  python scripts/train_tiny_model.py [--steps N] [--seed S] [--threads T] [--out DIR]
It writes model.safetensors and training.json into --out and the loss curve to docs/tiny_model_loss.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib
import torch
from tqdm import tqdm
from transformers import AutoTokenizer, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSET_DIR = REPO_ROOT / "sglang_lite" / "assets" / "tiny_qwen3_5_moe"
LOSS_PLOT = REPO_ROOT / "docs" / "tiny_model_loss.png"
HELDOUT_EVERY = 20  # every 20th corpus file (sorted order) is held out
DOC_SEPARATOR = "<|endoftext|>"


def load_tokenizer_script():
    """The tokenizer script's module, so both scripts read exactly the same corpus."""
    path = Path(__file__).resolve().parent / "make_tiny_tokenizer.py"
    spec = importlib.util.spec_from_file_location("make_tiny_tokenizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1400
    seed: int = 0
    corpus_bytes: int = (
        32 * 1024 * 1024
    )  # the whole stdlib (10 MB under the per-file cap); the tokenizer took 6 MB
    threads: int = 2
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = (
        200  # every eval scores the whole held-out split, so the points of the curve compare
    )


@dataclass(frozen=True)
class Split:
    tokens: torch.Tensor  # 1-D int64, documents joined with the separator
    n_bytes: int
    n_files: int


def split_corpus(stdlib: Path, max_bytes: int) -> tuple[list[str], list[str]]:
    documents = list(load_tokenizer_script().corpus(stdlib, max_bytes))
    train = [d for i, d in enumerate(documents) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [d for i, d in enumerate(documents) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return train, heldout


def tokenize(tokenizer, documents: list[str]) -> Split:
    separator = tokenizer.convert_tokens_to_ids(DOC_SEPARATOR)
    ids: list[int] = []
    for encoded in tokenizer(documents, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(separator)
    n_bytes = sum(len(d.encode()) for d in documents)
    return Split(torch.tensor(ids, dtype=torch.long), n_bytes, len(documents))


def windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens (inputs plus the shifted targets)."""
    n = (len(tokens) - 1) // seq_len
    starts = torch.arange(n) * seq_len
    return torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def batch_order(n_windows: int, cfg: TrainConfig) -> torch.Tensor:
    """Window indices for every step: seeded permutations, one epoch after another."""
    generator = torch.Generator().manual_seed(cfg.seed)
    needed = cfg.steps * cfg.batch_size
    epochs = [
        torch.randperm(n_windows, generator=generator) for _ in range(math.ceil(needed / n_windows))
    ]
    return torch.cat(epochs)[:needed].view(cfg.steps, cfg.batch_size)


def build_model(asset_dir: Path, seed: int) -> Qwen3_5MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig.from_pretrained(asset_dir)
    config.output_router_logits = (
        False  # the router aux loss stays off: 8 experts balance well enough here
    )
    return Qwen3_5MoeForCausalLM(config).float()


def next_token_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1)
    )


@torch.no_grad()
def evaluate(model, heldout: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss (nats/token) over the given windows."""
    model.eval()
    total = sum(
        next_token_loss(model, chunk).item() * len(chunk) for chunk in heldout.split(batch_size)
    )
    model.train()
    return total / len(heldout)


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.AdamW:
    # Weight decay on matrices only; norms, biases and the GDN gate parameters (A_log, dt_bias) are left alone.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def train(
    model, train_windows: torch.Tensor, heldout_windows: torch.Tensor, cfg: TrainConfig
) -> dict:
    optimizer = make_optimizer(model, cfg)
    order = batch_order(len(train_windows), cfg)
    curve: dict = {"train_steps": [], "train_loss": [], "heldout_steps": [], "heldout_loss": []}
    smoothed = None
    progress = tqdm(range(cfg.steps), desc="train", unit="step")
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = next_token_loss(model, train_windows[order[step]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        curve["train_steps"].append(step + 1)
        curve["train_loss"].append(loss.item())
        progress.set_postfix(loss=f"{smoothed:.3f}", lr=f"{lr_at(step, cfg):.2e}")
        if (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            heldout = evaluate(model, heldout_windows, cfg.batch_size)
            curve["heldout_steps"].append(step + 1)
            curve["heldout_loss"].append(heldout)
            tqdm.write(f"step {step + 1}: train {smoothed:.3f}, held-out {heldout:.3f} nats/token")
    return curve


def plot_curve(curve: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(curve["train_steps"], curve["train_loss"], lw=0.6, alpha=0.7, label="train (per batch)")
    ax.plot(curve["heldout_steps"], curve["heldout_loss"], "o-", label="held-out files")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("next-token loss (nats/token)")
    ax.set_title("tiny Qwen3.5-MoE on the Python standard library")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_checkpoint(model, out: Path) -> None:
    """model.safetensors in bfloat16 with the names save_pretrained writes; config and tokenizer are kept by hand."""
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        shutil.copyfile(Path(tmp) / "model.safetensors", out / "model.safetensors")
    model.float()


def parse_args() -> tuple[TrainConfig, Path, Path, Path]:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument(
        "--out", type=Path, default=ASSET_DIR, help="where model.safetensors and training.json go"
    )
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--corpus-bytes", type=int, default=defaults.corpus_bytes)
    parser.add_argument(
        "--plot", type=Path, default=LOSS_PLOT, help="where the loss curve PNG goes"
    )
    args = parser.parse_args()
    cfg = TrainConfig(
        steps=args.steps,
        seed=args.seed,
        threads=args.threads,
        corpus_bytes=args.corpus_bytes,
        warmup_steps=min(defaults.warmup_steps, max(1, args.steps // 10)),
    )
    return cfg, args.out, args.stdlib, args.plot


def main() -> None:
    cfg, out, stdlib, plot = parse_args()
    torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(ASSET_DIR)
    train_docs, heldout_docs = split_corpus(stdlib, cfg.corpus_bytes)
    train_split, heldout_split = tokenize(tokenizer, train_docs), tokenize(tokenizer, heldout_docs)
    train_windows = windows(train_split.tokens, cfg.seq_len)
    heldout_windows = windows(heldout_split.tokens, cfg.seq_len)
    print(
        f"train: {train_split.n_files} files, {train_split.n_bytes} bytes, {len(train_split.tokens)} tokens; "
        f"held-out: {heldout_split.n_files} files, {heldout_split.n_bytes} bytes, {len(heldout_split.tokens)} tokens"
    )
    model = build_model(ASSET_DIR, cfg.seed)
    curve = train(model, train_windows, heldout_windows, cfg)
    final_heldout = evaluate(model, heldout_windows, cfg.batch_size)
    curve["heldout_steps"].append(cfg.steps)
    curve["heldout_loss"].append(final_heldout)
    final_train = sum(curve["train_loss"][-50:]) / len(curve["train_loss"][-50:])
    wall = time.perf_counter() - started
    print(
        f"final: train {final_train:.3f} (mean of last 50 batches), held-out {final_heldout:.3f} nats/token, "
        f"{wall:.0f} s"
    )
    save_checkpoint(model, out)
    plot_curve(curve, plot)
    report = {
        **asdict(cfg),
        "python_version": sys.version.split()[0],
        "torch_version": torch.__version__,
        "heldout_every_nth_file": HELDOUT_EVERY,
        "corpus": {
            "train": {
                "files": train_split.n_files,
                "bytes": train_split.n_bytes,
                "tokens": len(train_split.tokens),
            },
            "heldout": {
                "files": heldout_split.n_files,
                "bytes": heldout_split.n_bytes,
                "tokens": len(heldout_split.tokens),
            },
        },
        "tokens_trained": cfg.steps * cfg.batch_size * cfg.seq_len,
        "final_train_loss": round(final_train, 4),
        "final_heldout_loss": round(final_heldout, 4),
        "heldout_curve": dict(
            zip(curve["heldout_steps"], [round(x, 4) for x in curve["heldout_loss"]])
        ),
        "wall_time_s": round(wall, 1),
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'model.safetensors'}, {out / 'training.json'} and {LOSS_PLOT}")


if __name__ == "__main__":
    main()
