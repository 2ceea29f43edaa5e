"""Train the built-in tiny Qwen3.5-MoE model (sglang_lite/assets/tiny_qwen3_5_moe/) on the Python standard library.

Why: with random weights the built-in model continues every prompt with noise, so demos, README examples and
tests of the serving path show nothing a reader can judge. A few minutes of training on the corpus its tokenizer
was built from (the standard library's source, present on every machine with Python, no download) gives a model
whose completions look like Python and whose held-out loss is a number a test can bound.

How, in three stages (``--stages``, all by default):

1. base: the corpus is read by scripts/make_tiny_tokenizer.py's iterator (imported, not copied): stdlib files in
   sorted order, each capped at 64 KiB, here with a byte cap that takes the whole standard library (about 10 MB;
   the tokenizer was trained on the first 6 MB). A run on the 6 MB corpus alone reached a held-out loss of 2.23 but
   repeated docstrings when decoding greedily; the whole library gave 2.57 held-out, 2.80 against 3.20 on unseen
   Python, and code-like greedy completions. Every HELDOUT_EVERY-th file is held out and never trained on. Each
   split is tokenised with the asset tokenizer, documents joined with <|endoftext|>, and cut into fixed windows;
   the training order is a seeded permutation of the windows. The model is the transformers reference
   Qwen3_5MoeForCausalLM built from the asset config.json (on a CPU transformers uses its pure-PyTorch gated delta
   rule, which is differentiable). AdamW with a linear warmup and cosine decay runs a fixed number of steps.
2. chat: the chat format the server renders (the model's own chat template, thinking on), on conversations built
   from the training files' functions: a docstring's first sentence phrased as a request, a short thinking line
   naming the signature, the function without its docstring as the answer in a ```python block. Batches mix
   conversations (loss on the reply) with corpus windows so that the held-out Python loss does not get worse.
3. mtp: the multi-token-prediction head the checkpoint declares (``mtp.*``, ``mtp_num_hidden_layers`` 1), as
   Qwen3.5 releases ship one: distilled from the frozen model (it learns the model's own distribution of the token
   after next), so that speculative decoding (``--speculative-algorithm NEXTN``) has drafts worth verifying.

A given seed, step counts and Python version give the same run. The checkpoint is written in bfloat16 with the
standard transformers tensor names plus the head's; config.json gains ``mtp_num_hidden_layers``, the tokenizer
files are left as they are. Without the base stage the model starts from ``--init`` (the shipped checkpoint), and
training.json keeps that checkpoint's base record.

Run from the repository root:  python scripts/train_tiny_model.py [--stages base,chat,mtp] [--steps N] [--seed S]
[--threads T] [--out DIR]. It writes model.safetensors, config.json and training.json into --out, the base loss curve
to docs/tiny_model_loss.png and the chat and MTP stages' curves to docs/tiny_model_chat_mtp.png.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import random
import shutil
import sys
import sysconfig
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import matplotlib
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoTokenizer, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSET_DIR = REPO_ROOT / "sglang_lite" / "assets" / "tiny_qwen3_5_moe"
LOSS_PLOT = REPO_ROOT / "docs" / "tiny_model_loss.png"
CHAT_MTP_PLOT = REPO_ROOT / "docs" / "tiny_model_chat_mtp.png"
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


# ---- stage 2: the chat format -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatConfig:
    """Conversations built from the training files' functions (a function's docstring asks for it, the function
    without its docstring answers), rendered with the model's own chat template; each batch is a quarter
    conversations (loss on the reply only) and the rest corpus windows, so that the held-out Python loss does not
    get worse (half and half, 400 steps: 2.569 -> 2.578)."""

    steps: int = 600
    # where the base stage ended: higher raised the held-out Python loss (2.57 -> 2.67 after 100 steps at 1e-3)
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    chat_rows: int = (
        4  # of each batch's rows; the others are corpus windows, weighted by their rows
    )
    max_function_chars: int = 1200
    eval_every: int = 100


@dataclass(frozen=True)
class Conversation:
    request: str
    reasoning: str
    answer: str


# the verbs a docstring's summary starts with, so that "Return the sum." becomes "... that returns the sum."
VERBS = frozenset(
    "add append apply build calculate call check clear close compute construct convert copy count create decode "
    "delete determine emit encode ensure escape extract fetch find format generate get handle initialize insert "
    "join load make match merge normalize open parse print process read register remove rename replace reset "
    "resolve return reverse run save search send set sort split start stop strip test translate update validate "
    "wait write".split()
)
REQUESTS = (
    "Write a {kind} that {does}",
    "Write a Python {kind} `{name}` that {does}",
    "Can you write a {kind} that {does}",
    "Implement `{signature}`: {summary}",
    "{summary}",
)


def third_person(summary: str) -> str | None:
    """'Return the sum.' -> 'returns the sum.'; None unless the summary starts with a verb of VERBS."""
    word, _, rest = summary.partition(" ")
    verb = word.lower()
    if not rest:
        return None
    if verb in VERBS:
        if verb.endswith(("s", "sh", "ch", "x", "z")):
            verb += "es"
        elif verb.endswith("y") and verb[-2] not in "aeiou":
            verb = verb[:-1] + "ies"
        else:
            verb += "s"
    elif not (
        verb.endswith("s")
        and (verb[:-1] in VERBS or verb[:-2] in VERBS or verb[:-3] + "y" in VERBS)
    ):
        return None
    return f"{verb} {rest}"


def summary_of(docstring: str) -> str | None:
    """The docstring's first sentence, when it reads as a request (15-120 characters of prose)."""
    first = " ".join(docstring.strip().split("\n\n")[0].split())
    sentence = first.split(". ")[0].rstrip(".") + "."
    if not 15 <= len(sentence) <= 120 or not sentence[0].isalpha() or ">>>" in sentence:
        return None
    return sentence[0].upper() + sentence[1:]


def conversations(documents: list[str], cfg: ChatConfig, seed: int) -> list[Conversation]:
    """One conversation per public function with a usable docstring in ``documents`` (a seeded phrasing each)."""
    rng = random.Random(seed)
    out = []
    for document in documents:
        try:
            tree = ast.parse(document)
        except SyntaxError:
            continue
        lines = document.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith(("_", "test")):
                continue
            docstring = ast.get_docstring(node)
            summary = summary_of(docstring) if docstring else None
            if summary is None or node.body[0].lineno == node.lineno:
                continue
            # the answer is the function without its docstring: the request said what it does
            first, last = node.body[0].lineno, node.body[0].end_lineno
            kept = lines[node.lineno - 1 : first - 1] + lines[last : node.end_lineno]
            source = textwrap.dedent("\n".join(kept))
            if len(source) > cfg.max_function_chars or len(kept) < 3:
                continue
            signature = f"{node.name}({ast.unparse(node.args)})"
            method = bool(node.args.args) and node.args.args[0].arg in ("self", "cls")
            does = third_person(summary)
            phrasing = rng.choice(REQUESTS if does else REQUESTS[3:])
            request = phrasing.format(
                kind="method" if method else "function",
                does=does,
                name=node.name,
                signature=signature,
                summary=summary,
            )
            reasoning = f"I will write `{signature}`" + (f", which {does}" if does else ".")
            out.append(Conversation(request, reasoning, f"```python\n{source}\n```"))
    rng.shuffle(out)
    return out


def render(tokenizer, conversation: Conversation) -> tuple[list[int], list[int]]:
    """The conversation's tokens as the server would see them (the prompt, with the generation prompt, tokenised
    alone, then the reply up to <|im_end|>) and a mask that is 1 on the reply."""
    user = [{"role": "user", "content": conversation.request}]
    prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assistant = {
        "role": "assistant",
        "content": conversation.answer,
        "reasoning_content": conversation.reasoning,
    }
    whole = tokenizer.apply_chat_template(user + [assistant], tokenize=False)
    assert whole.startswith(prompt), "the chat template's generation prompt must start the reply"
    reply = whole[len(prompt) :].rstrip("\n")  # ... </think>\n\n```python ...```<|im_end|>
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    reply_ids = tokenizer.encode(reply, add_special_tokens=False)
    return prompt_ids + reply_ids, [0] * len(prompt_ids) + [1] * len(reply_ids)


def chat_windows(
    tokenizer, convs: list[Conversation], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The conversations joined with the document separator and cut into windows, with their reply masks."""
    separator = tokenizer.convert_tokens_to_ids(DOC_SEPARATOR)
    ids: list[int] = []
    mask: list[int] = []
    for conversation in convs:
        tokens, reply = render(tokenizer, conversation)
        ids += tokens + [separator]
        mask += reply + [0]
    return windows(torch.tensor(ids), seq_len), windows(torch.tensor(mask), seq_len)


def token_losses(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(
        logits.transpose(1, 2).float(), batch[:, 1:], reduction="none"
    )  # [rows, seq_len]


def masked_mean(losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.float()
    return (losses * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def evaluate_chat(model, chat: tuple[torch.Tensor, torch.Tensor], batch_size: int) -> float:
    """Mean loss (nats/token) on the replies of the held-out conversations."""
    model.eval()
    total = count = 0.0
    for ids, mask in zip(chat[0].split(batch_size), chat[1].split(batch_size)):
        losses = token_losses(model, ids)
        total += (losses * mask[:, 1:]).sum().item()
        count += mask[:, 1:].sum().item()
    model.train()
    return total / max(count, 1)


def mixed_orders(
    chat_windows: int, corpus_windows: int, cfg: ChatConfig | MtpConfig, base: TrainConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each step's conversation windows (``cfg.chat_rows``) and corpus windows (the rest of a batch)."""
    corpus_rows = base.batch_size - cfg.chat_rows
    chat = batch_order(chat_windows, replace(base, steps=cfg.steps, batch_size=cfg.chat_rows))
    corpus = batch_order(corpus_windows, replace(base, steps=cfg.steps, batch_size=corpus_rows))
    return chat, corpus


def train_chat(
    model,
    chat: tuple[torch.Tensor, torch.Tensor],
    corpus: torch.Tensor,
    heldout: dict,
    cfg: ChatConfig,
    base: TrainConfig,
) -> dict:
    """Fine-tunes on replies and corpus windows at once (the two mean losses weighted by their rows)."""
    optimizer = make_optimizer(model, replace(base, lr=cfg.lr))
    corpus_rows = base.batch_size - cfg.chat_rows
    chat_order, corpus_order = mixed_orders(len(chat[0]), len(corpus), cfg, base)
    curve: dict = {"steps": [], "reply_loss": [], "eval_steps": [], "heldout": []}

    def record(step: int) -> None:
        curve["eval_steps"].append(step)
        curve["heldout"].append(
            {
                "replies": evaluate_chat(model, heldout["chat"], base.batch_size),
                "python": evaluate(model, heldout["python"], base.batch_size),
            }
        )
        tqdm.write(f"chat step {step}: held-out {curve['heldout'][-1]}")

    record(0)
    progress = tqdm(range(cfg.steps), desc="chat", unit="step")
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        rows = chat_order[step]
        batch = torch.cat([chat[0][rows], corpus[corpus_order[step]]])
        losses = token_losses(model, batch)
        reply = masked_mean(losses[: cfg.chat_rows], chat[1][rows][:, 1:])
        loss = (
            cfg.chat_rows * reply + corpus_rows * losses[cfg.chat_rows :].mean()
        ) / base.batch_size
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), base.grad_clip)
        optimizer.step()
        curve["steps"].append(step + 1)
        curve["reply_loss"].append(reply.item())
        progress.set_postfix(reply=f"{reply.item():.3f}", lr=f"{lr_at(step, cfg):.2e}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            record(step + 1)
    return curve


# ---- stage 3: the MTP head ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MtpConfig:
    """The head is distilled from the frozen model: at each position it learns the model's own distribution of the
    token after next (a draft is accepted when it is the model's choice, not the corpus's)."""

    steps: int = 600
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    chat_rows: int = 8
    eval_every: int = 150


class MtpHead(torch.nn.Module):
    """The MTP head as checkpoints store it (``mtp.*``; sglang_lite.models.qwen3_5.Qwen3_5MTP serves it): the next
    token's embedding and the model's final hidden state, each RMS-normed, concatenated, projected 2H -> H by
    ``fc``, one full-attention decoder layer and a final norm, then the model's LM head. The layer and the final
    norm are those of a one-layer transformers model (its embedding and LM head unused: the model's are shared and
    frozen), started from the model's own full-attention layer and final norm."""

    def __init__(self, model) -> None:
        super().__init__()
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

        config = model.config.to_dict()
        config.update(num_hidden_layers=1, layer_types=["full_attention"])
        self.wrapper = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**config)).float()
        self.wrapper.requires_grad_(False)
        body = self.wrapper.model
        full = model.config.layer_types.index("full_attention")
        body.layers[0].load_state_dict(model.model.layers[full].state_dict())
        body.norm.load_state_dict(model.model.norm.state_dict())
        body.layers.requires_grad_(True)
        body.norm.requires_grad_(True)
        hidden = model.config.hidden_size
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(hidden, model.config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(hidden, model.config.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():  # start by passing the hidden state through, the embedding a little
            self.fc.weight.copy_(
                torch.cat([torch.eye(hidden) * 0.5, torch.eye(hidden)], dim=1)
                + torch.randn(hidden, 2 * hidden) * 0.01
            )

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def forward(self, model, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of the token after ``next_ids`` [B, T], given the model's final hidden states
        ``hidden`` [B, T, H] at the positions before them."""
        embedded = torch.nn.functional.embedding(next_ids, model.model.embed_tokens.weight)
        joined = torch.cat(
            [self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1
        )
        out = self.wrapper.model(inputs_embeds=self.fc(joined), use_cache=False).last_hidden_state
        return torch.nn.functional.linear(out, model.lm_head.weight)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The head's tensors under the names released checkpoints use, in bfloat16."""
        with (
            tempfile.TemporaryDirectory() as tmp
        ):  # the layout save_pretrained writes, as the model's
            self.wrapper.save_pretrained(tmp, safe_serialization=True)
            state = load_file(Path(tmp) / "model.safetensors")
        out = {
            "mtp." + name[len("model.") :]: tensor
            for name, tensor in state.items()
            if name.startswith("model.layers.0.") or name == "model.norm.weight"
        }
        out["mtp.fc.weight"] = self.fc.weight.detach()
        out["mtp.pre_fc_norm_embedding.weight"] = self.pre_fc_norm_embedding.weight.detach()
        out["mtp.pre_fc_norm_hidden.weight"] = self.pre_fc_norm_hidden.weight.detach()
        return {name: t.to(torch.bfloat16).contiguous() for name, t in out.items()}


def mtp_step(model, head: MtpHead, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's distillation loss over ``batch`` and the share of positions where its choice is the model's."""
    ids = batch[:, :-1]
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        target = torch.softmax(model.lm_head(hidden[:, 1:]).float(), dim=-1)
    logits = head(model, ids[:, 1:], hidden[:, :-1]).float()
    loss = -(target * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    agree = (logits.argmax(-1) == target.argmax(-1)).float().mean()
    return loss, agree


@torch.no_grad()
def evaluate_mtp(model, head: MtpHead, heldout: torch.Tensor, batch_size: int) -> dict:
    head.eval()
    losses, agrees = [], []
    for chunk in heldout.split(batch_size):
        loss, agree = mtp_step(model, head, chunk)
        losses.append(loss.item() * len(chunk))
        agrees.append(agree.item() * len(chunk))
    head.train()
    return {"loss": sum(losses) / len(heldout), "agreement": sum(agrees) / len(heldout)}


def train_mtp(
    model,
    chat: torch.Tensor,
    corpus: torch.Tensor,
    heldout: dict,
    cfg: MtpConfig,
    base: TrainConfig,
) -> tuple[MtpHead, dict]:
    model.eval()
    model.requires_grad_(False)
    head = MtpHead(model)
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in head.trained_parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in head.trained_parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    chat_order, corpus_order = mixed_orders(len(chat), len(corpus), cfg, base)
    curve: dict = {"steps": [], "loss": [], "agreement": [], "eval_steps": [], "heldout": []}

    def record(step: int) -> None:
        curve["eval_steps"].append(step)
        curve["heldout"].append(
            {
                name: evaluate_mtp(model, head, windows_, base.batch_size)
                for name, windows_ in heldout.items()
            }
        )
        tqdm.write(f"mtp step {step}: held-out {curve['heldout'][-1]}")

    record(0)
    progress = tqdm(range(cfg.steps), desc="mtp", unit="step")
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = torch.cat([chat[chat_order[step]], corpus[corpus_order[step]]])
        loss, agree = mtp_step(model, head, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.trained_parameters(), base.grad_clip)
        optimizer.step()
        curve["steps"].append(step + 1)
        curve["loss"].append(loss.item())
        curve["agreement"].append(agree.item())
        progress.set_postfix(loss=f"{loss.item():.3f}", agree=f"{agree.item():.2f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            record(step + 1)
    return head, curve


def save_mtp_head(head: MtpHead, out: Path) -> None:
    """Appends the head's tensors to out/model.safetensors and declares it in out/config.json."""
    file = out / "model.safetensors"
    tensors = {k: v for k, v in load_file(file).items() if not k.startswith("mtp.")}
    tensors.update(head.tensors())
    save_file(tensors, file, metadata={"format": "pt"})
    config_file = out / "config.json"
    config = json.loads(
        (config_file if config_file.exists() else ASSET_DIR / "config.json").read_text()
    )
    config["mtp_num_hidden_layers"] = 1
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def plot_chat_mtp(chat: dict | None, mtp: dict | None, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if chat:
        ax = axes[0]
        ax.plot(chat["steps"], chat["reply_loss"], lw=0.6, alpha=0.6, label="replies (per batch)")
        for key, style in (("replies", "o-"), ("python", "s-")):
            ax.plot(
                chat["eval_steps"],
                [h[key] for h in chat["heldout"]],
                style,
                label=f"held-out {key}",
            )
        ax.set_title("chat stage")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    if mtp:
        ax = axes[1]
        ax.plot(mtp["steps"], mtp["agreement"], lw=0.6, alpha=0.6, label="train (per batch)")
        for key in mtp["heldout"][0]:
            ax.plot(
                mtp["eval_steps"],
                [h[key]["agreement"] for h in mtp["heldout"]],
                "o-",
                label=f"held-out {key}",
            )
        ax.set_title("MTP head: its draft is the model's next choice")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("share of positions")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


STAGES = ("base", "chat", "mtp")


def parse_args() -> argparse.Namespace:
    defaults, chat, mtp = TrainConfig(), ChatConfig(), MtpConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stages",
        default=",".join(STAGES),
        help="which of base,chat,mtp to run; without base the model starts from --init",
    )
    parser.add_argument(
        "--init", type=Path, default=ASSET_DIR, help="the checkpoint the chat stage starts from"
    )
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--chat-steps", type=int, default=chat.steps)
    parser.add_argument("--mtp-steps", type=int, default=mtp.steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument(
        "--out", type=Path, default=ASSET_DIR, help="where model.safetensors and training.json go"
    )
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--corpus-bytes", type=int, default=defaults.corpus_bytes)
    parser.add_argument(
        "--plot", type=Path, default=LOSS_PLOT, help="where the base loss curve PNG goes"
    )
    parser.add_argument(
        "--chat-mtp-plot", type=Path, default=CHAT_MTP_PLOT, help="the chat and MTP stages' PNG"
    )
    args = parser.parse_args()
    args.stages = [stage for stage in args.stages.split(",") if stage]
    unknown = set(args.stages) - set(STAGES)
    if unknown:
        parser.error(f"unknown --stages {sorted(unknown)}; choose from {','.join(STAGES)}")
    args.base = TrainConfig(
        steps=args.steps,
        seed=args.seed,
        threads=args.threads,
        corpus_bytes=args.corpus_bytes,
        warmup_steps=min(defaults.warmup_steps, max(1, args.steps // 10)),
    )
    args.chat = replace(chat, steps=args.chat_steps)
    args.mtp = replace(mtp, steps=args.mtp_steps)
    return args


def run_base(model_windows: tuple, cfg: TrainConfig, splits: tuple, plot: Path) -> tuple:
    """Stage 1 (the model from random weights): the model and training.json's base fields."""
    train_windows, heldout_windows = model_windows
    train_split, heldout_split = splits
    model = build_model(ASSET_DIR, cfg.seed)
    curve = train(model, train_windows, heldout_windows, cfg)
    final_heldout = evaluate(model, heldout_windows, cfg.batch_size)
    curve["heldout_steps"].append(cfg.steps)
    curve["heldout_loss"].append(final_heldout)
    final_train = sum(curve["train_loss"][-50:]) / len(curve["train_loss"][-50:])
    print(
        f"base: train {final_train:.3f} (last 50 batches), held-out {final_heldout:.3f} nats/token"
    )
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
    }
    return model, report


def main() -> None:
    args = parse_args()
    base = args.base
    torch.set_num_threads(base.threads)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(ASSET_DIR)
    train_docs, heldout_docs = split_corpus(args.stdlib, base.corpus_bytes)
    train_split, heldout_split = tokenize(tokenizer, train_docs), tokenize(tokenizer, heldout_docs)
    train_windows = windows(train_split.tokens, base.seq_len)
    heldout_windows = windows(heldout_split.tokens, base.seq_len)
    print(
        f"train: {train_split.n_files} files, {train_split.n_bytes} bytes, {len(train_split.tokens)} tokens; "
        f"held-out: {heldout_split.n_files} files, {heldout_split.n_bytes} bytes, {len(heldout_split.tokens)} tokens"
    )
    if "base" in args.stages:
        model, report = run_base(
            (train_windows, heldout_windows),
            base,
            (train_split, heldout_split),
            args.plot,
        )
    else:  # the base stage's record stays as it was
        model = Qwen3_5MoeForCausalLM.from_pretrained(args.init, dtype=torch.float32).train()
        record = args.init / "training.json"
        report = json.loads(record.read_text()) if record.exists() else {}
        report = {k: v for k, v in report.items() if k not in ("chat", "mtp", "wall_time_s")}
    chat_curve = mtp_curve = None
    if "chat" in args.stages or "mtp" in args.stages:
        chat_train = chat_windows(
            tokenizer, conversations(train_docs, args.chat, base.seed), base.seq_len
        )
        chat_heldout = chat_windows(
            tokenizer, conversations(heldout_docs, args.chat, base.seed), base.seq_len
        )
        print(
            f"conversations: {len(chat_train[0])} training windows, {len(chat_heldout[0])} held-out windows"
        )
    if "chat" in args.stages:
        heldout = {"chat": chat_heldout, "python": heldout_windows}
        chat_curve = train_chat(model, chat_train, train_windows, heldout, args.chat, base)
        first, last = chat_curve["heldout"][0], chat_curve["heldout"][-1]
        report["chat"] = {
            **asdict(args.chat),
            "conversation_windows": {"train": len(chat_train[0]), "heldout": len(chat_heldout[0])},
            "heldout_reply_loss": {
                "before": round(first["replies"], 4),
                "after": round(last["replies"], 4),
            },
            "heldout_python_loss": {
                "before": round(first["python"], 4),
                "after": round(last["python"], 4),
            },
        }
        report["final_heldout_loss"] = round(last["python"], 4)
    save_checkpoint(model, args.out)
    for asset in ASSET_DIR.iterdir():  # a model directory elsewhere is complete too
        if asset.suffix == ".json" and asset.name != "training.json":
            target = args.out / asset.name
            if not target.exists():
                shutil.copyfile(asset, target)
    if "mtp" in args.stages:
        heldout = {"python": heldout_windows, "chat": chat_heldout[0]}
        head, mtp_curve = train_mtp(model, chat_train[0], train_windows, heldout, args.mtp, base)
        save_mtp_head(head, args.out)
        last = mtp_curve["heldout"][-1]
        report["mtp"] = {
            **asdict(args.mtp),
            "heldout_agreement": {k: round(v["agreement"], 4) for k, v in last.items()},
            "heldout_distillation_loss": {k: round(v["loss"], 4) for k, v in last.items()},
        }
    if chat_curve or mtp_curve:
        plot_chat_mtp(chat_curve, mtp_curve, args.chat_mtp_plot)
    report["wall_time_s"] = round(time.perf_counter() - started, 1)
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out / 'model.safetensors'} and {args.out / 'training.json'}: {report}")


if __name__ == "__main__":
    main()
