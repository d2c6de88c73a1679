"""Train the embedded default model ``model=tiny`` and its tokenizer, deterministically.

``python -m moeexp.models.tiny.train`` (what ``make tiny-model`` runs) does, in order:

1. loads ShareGPT (:func:`moeexp.data.sharegpt.load_sharegpt`), drops every held-out
   conversation (:func:`moeexp.data.sharegpt.is_model_heldout`), shuffles the rest with a
   fixed seed and formats each as ``"User: ...\\nAssistant: ..."`` text;
2. trains a byte-level BPE tokenizer (vocab 4096, ``<pad>``=0, ``<bos>``=1, ``<eos>``=2)
   on the first ``tokenizer_chars`` characters of that text; the saved tokenizer prepends
   ``<bos>`` when encoding (post-processor), so ``AutoTokenizer`` users and lm-eval get it;
3. packs ``<bos> doc <eos>`` token streams into sequences of ``seq_len`` tokens;
4. trains a Mixtral (8 layers x 16 experts, top-2, hidden 64) with next-token cross-entropy
   plus a *per-layer* Switch load-balancing loss (mean over layers, coefficient 0.1), AdamW,
   warm-up then cosine decay, for a fixed number of steps;
5. writes ``model.safetensors`` (bf16), ``config.json``, the tokenizer files and
   ``training_info.json`` to ``src/moeexp/assets/tiny/`` (atomically: a temp dir renamed).

Validation = the held-out conversations (never trained on). Everything is seeded, data
order is fixed and ``torch.use_deterministic_algorithms(True)`` is on, so a rerun on the
same software stack and thread count reproduces the weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from moeexp.paths import ASSETS_DIR as PACKAGE_ASSETS

log = logging.getLogger(__name__)

#: Where the shipped weights and tokenizer live (package data).
ASSETS_DIR = PACKAGE_ASSETS / "tiny"
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
ROLE_NAMES = {
    "human": "User",
    "user": "User",
    "gpt": "Assistant",
    "chatgpt": "Assistant",
    "bing": "Assistant",
    "bard": "Assistant",
    "system": "System",
}


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a tiny-model training run (all fixed, nothing time-based).

    Attributes:
        steps: optimizer steps; tokens seen = steps * batch_size * seq_len.
        lr: peak AdamW learning rate; ``warmup`` linear steps, then cosine to
            ``min_lr_frac * lr`` at the last step.
        balance_coef: weight of the per-layer Switch balancing loss (mean over layers), i.e.
            0.0125 per layer, Switch Transformer's 0.01-per-layer scale. 0.02 (the trial's
            value) left two layer-0 experts at 0.4-0.8% of routed tokens (see the card).
        max_doc_tokens: conversations are cut to this many tokens (more distinct documents).
        tokenizer_chars: characters of training text the BPE tokenizer is trained on.
        val_seqs: held-out sequences of ``seq_len`` tokens used for validation.
    """

    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 4
    num_experts: int = 16
    top_k: int = 2
    max_positions: int = 512
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1000
    lr: float = 3e-3
    warmup: int = 30
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    balance_coef: float = 0.1
    max_doc_tokens: int = 1024
    tokenizer_chars: int = 16_000_000
    val_seqs: int = 128
    eval_every: int = 250
    threads: int = 1  # one thread: identical results on any machine, no OMP spin under load


# ----------------------------------------------------------------------------- data
def format_conversation(conv: dict[str, Any]) -> str | None:
    """A ShareGPT conversation as plain text, one ``"Role: text"`` turn per paragraph.

    Returns None when no turn has text. Unknown roles keep their raw name.
    """
    parts = []
    for turn in conv.get("conversations") or []:
        text = turn.get("value")
        if not isinstance(text, str) or not text.strip():
            continue
        role = ROLE_NAMES.get(str(turn.get("from")), str(turn.get("from")))
        parts.append(f"{role}: {text.strip()}")
    return "\n".join(parts) if parts else None


def format_prompt(user_text: str) -> str:
    """The text a model prompt starts with (same format as training): ``"User: ...\\nAssistant:"``."""
    return f"User: {user_text.strip()}\nAssistant:"


def split_texts(convs: Sequence[dict[str, Any]], seed: int) -> tuple[list[str], list[str]]:
    """(train texts in a seeded shuffled order, held-out texts in file order)."""
    from moeexp.data.sharegpt import is_model_heldout

    train_idx = [i for i in range(len(convs)) if not is_model_heldout(i)]
    order = np.random.default_rng(seed).permutation(len(train_idx))
    train = [format_conversation(convs[train_idx[j]]) for j in order]
    held = [format_conversation(convs[i]) for i in range(len(convs)) if is_model_heldout(i)]
    return [t for t in train if t], [t for t in held if t]


def train_tokenizer(texts: Sequence[str], vocab_size: int, max_chars: int) -> Any:
    """Byte-level BPE (HF ``tokenizers``) on the first ``max_chars`` characters of ``texts``.

    Special tokens get ids 0/1/2 (``<pad>``, ``<bos>``, ``<eos>``); the post-processor
    prepends ``<bos>`` when ``add_special_tokens`` is on. Trained single-threaded
    (``TOKENIZERS_PARALLELISM=false``) so the merges are deterministic.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    def corpus() -> Iterator[str]:
        used = 0
        for t in texts:
            if used >= max_chars:
                return
            yield t
            used += len(t)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    assert [tok.token_to_id(s) for s in (PAD, BOS, EOS)] == [PAD_ID, BOS_ID, EOS_ID]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def wrap_tokenizer(tok: Any, seq_limit: int) -> Any:
    """A transformers ``PreTrainedTokenizerFast`` around a trained ``tokenizers.Tokenizer``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=seq_limit,
        clean_up_tokenization_spaces=False,
    )


def pack(
    texts: Sequence[str], tok: Any, seq_len: int, n_seqs: int, max_doc: int, desc: str = "tokenize"
) -> torch.Tensor:
    """``<bos> doc <eos>`` streams (docs cut to ``max_doc`` tokens) packed into ``[n_seqs, seq_len]``.

    Raises ValueError when the texts hold fewer than ``n_seqs * seq_len`` tokens.
    """
    need = n_seqs * seq_len
    buf: list[int] = []
    chunk = 256
    with tqdm(total=need, desc=desc, unit="tok", disable=None) as bar:
        for s in range(0, len(texts), chunk):
            for enc in tok.encode_batch(list(texts[s : s + chunk]), add_special_tokens=False):
                ids = [BOS_ID, *enc.ids[: max_doc - 2], EOS_ID]
                buf.extend(ids)
                bar.update(min(len(ids), max(0, need - bar.n)))
            if len(buf) >= need:
                break
    if len(buf) < need:
        raise ValueError(f"{desc}: only {len(buf)} tokens available, {need} needed")
    return torch.tensor(buf[:need], dtype=torch.long).view(n_seqs, seq_len)


# ---------------------------------------------------------------------------- model
def build_config(cfg: TrainConfig) -> Any:
    """The ``MixtralConfig`` of the tiny model (tied embeddings, RoPE theta 10k, fp32)."""
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        use_cache=True,
    )


def balance_loss(router_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """Per-layer Switch balancing loss ``J * sum_j f_j P_j``, averaged over layers.

    Args:
        router_logits: one ``[T, J]`` tensor per MoE layer (T tokens, J experts).
        top_k: experts chosen per token; ``f_j`` is the fraction of the T*top_k
            assignments that went to expert j (no gradient), ``P_j`` the mean router
            probability of j (gradient). Equals 1.0 for perfectly uniform routing.
    """
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        n_exp = probs.shape[-1]
        idx = torch.topk(probs, top_k, dim=-1).indices
        frac = F.one_hot(idx, n_exp).sum(dim=1).float().mean(dim=0) / top_k
        losses.append(n_exp * (frac.detach() * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def lm_losses(model: Any, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token cross-entropy in nats/token, per-layer balancing loss) for ``x[B, T]``."""
    out = model(input_ids=x, output_router_logits=True, use_cache=False)
    logits = out.logits[:, :-1]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
    return ce, balance_loss(out.router_logits, top_k)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> tuple[Any, Any]:
    """AdamW (decay on matrices only) + warm-up/cosine ``LambdaLR`` schedule."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train_step(
    model: Any, opt: Any, sched: Any, x: torch.Tensor, cfg: TrainConfig
) -> tuple[float, float]:
    """One optimizer step on batch ``x[B, T]``; returns (cross-entropy, balancing loss)."""
    model.train()
    ce, bal = lm_losses(model, x, cfg.top_k)
    loss = ce + cfg.balance_coef * bal
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    opt.step()
    sched.step()
    return ce.item(), bal.item()


@torch.no_grad()
def evaluate(model: Any, data: torch.Tensor, batch_size: int, top_k: int) -> tuple[float, float]:
    """Mean (cross-entropy, balancing loss) over the sequences of ``data[N, T]`` (eval mode)."""
    model.eval()
    ces, bals = [], []
    for s in range(0, data.shape[0], batch_size):
        ce, bal = lm_losses(model, data[s : s + batch_size], top_k)
        ces.append(float(ce))
        bals.append(float(bal))
    return float(np.mean(ces)), float(np.mean(bals))


def set_determinism(seed: int, threads: int) -> None:
    """Seeds, thread count and deterministic kernels."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


# ----------------------------------------------------------------------------- main
def run(cfg: TrainConfig, out_dir: Path) -> dict[str, Any]:
    """Train tokenizer + model and write the assets to ``out_dir``; returns training info."""
    from transformers import MixtralForCausalLM

    from moeexp.data.sharegpt import load_sharegpt

    t0 = time.perf_counter()
    set_determinism(cfg.seed, cfg.threads)
    train_texts, held_texts = split_texts(load_sharegpt(), cfg.seed)
    log.info("%d training / %d held-out conversations", len(train_texts), len(held_texts))
    tok = train_tokenizer(train_texts, cfg.vocab_size, cfg.tokenizer_chars)
    log.info("tokenizer trained (%.0f s)", time.perf_counter() - t0)
    train = pack(
        train_texts,
        tok,
        cfg.seq_len,
        cfg.steps * cfg.batch_size,
        cfg.max_doc_tokens,
        "tokenize train",
    )
    val = pack(held_texts, tok, cfg.seq_len, cfg.val_seqs, cfg.max_doc_tokens, "tokenize val")
    t_data = time.perf_counter() - t0

    torch.manual_seed(cfg.seed)
    model = MixtralForCausalLM(build_config(cfg)).float()
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %.2f M parameters", n_params / 1e6)
    opt, sched = make_optimizer(model, cfg)
    history: list[dict[str, float]] = []
    t_train = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="train", unit="step", disable=None)
    ema = None
    for step in bar:
        x = train[step * cfg.batch_size : (step + 1) * cfg.batch_size]
        ce, bal = train_step(model, opt, sched, x, cfg)
        ema = ce if ema is None else 0.98 * ema + 0.02 * ce
        bar.set_postfix(ce=f"{ema:.3f}", bal=f"{bal:.3f}")
        last = step + 1 == cfg.steps
        if (step + 1) % 50 == 0 or last:
            tps = (step + 1) * x.numel() / (time.perf_counter() - t_train)
            log.info(
                "step %d/%d ce %.4f (ema %.4f) bal %.4f lr %.2e %.0f tok/s",
                step + 1,
                cfg.steps,
                ce,
                ema,
                bal,
                sched.get_last_lr()[0],
                tps,
            )
        if (step + 1) % cfg.eval_every == 0 or last:
            vce, vbal = evaluate(model, val, cfg.batch_size, cfg.top_k)
            history.append({"step": step + 1, "train_ce_ema": ema, "val_ce": vce, "val_bal": vbal})
            log.info("step %d val ce %.4f (ppl %.1f) bal %.4f", step + 1, vce, math.exp(vce), vbal)
    train_s = time.perf_counter() - t_train

    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    vce16, _ = evaluate(model.float(), val, cfg.batch_size, cfg.top_k)  # bf16-rounded weights
    model = model.to(torch.bfloat16)
    info = {
        "config": asdict(cfg),
        "parameters": n_params,
        "tokens_trained": cfg.steps * cfg.batch_size * cfg.seq_len,
        "val_tokens": int(val.numel()),
        "final_val_ce_fp32": history[-1]["val_ce"],
        "final_val_ce_bf16": vce16,
        "final_val_ppl_bf16": math.exp(vce16),
        "history": history,
        "data_prep_s": round(t_data, 1),
        "train_s": round(train_s, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
        "torch": torch.__version__,
        "command": "python -m moeexp.models.tiny.train",
    }
    save(model, wrap_tokenizer(tok, cfg.max_positions), info, out_dir)
    return info


def save(model: Any, hf_tok: Any, info: dict[str, Any], out_dir: Path) -> None:
    """Write weights (bf16 safetensors), config, tokenizer and info; temp dir then rename."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    hf_tok.save_pretrained(tmp)
    (tmp / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    log.info("wrote %s (%.2f MB)", out_dir, size / 1e6)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: ``python -m moeexp.models.tiny.train [--steps N] [--out DIR] [--seed S]``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--out", type=Path, default=ASSETS_DIR)
    p.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = TrainConfig(steps=a.steps, seed=a.seed, eval_every=a.eval_every)
    info = run(cfg, a.out)
    log.info(
        "done: val ce %.4f (ppl %.1f), %d tokens, %.0f s",
        info["final_val_ce_bf16"],
        info["final_val_ppl_bf16"],
        info["tokens_trained"],
        info["wall_s"],
    )


if __name__ == "__main__":
    main()
