"""Train the headsurgeon "model organism": a small BLOOM (ALiBi) model, from scratch, on CPU.

Pipeline (all seeded; single CPU thread):

1. A byte-level BPE tokenizer (vocab 4096; ``<unk> <s> </s> <pad>`` at ids 0-3, as BLOOM) is
   trained on the two bundled train corpora (``headsurgeon/corpora/``) and wrapped as a
   ``PreTrainedTokenizerFast`` that, like BLOOM's, adds no BOS token.
2. ``BloomForCausalLM`` (default 4 layers x 16 heads x 256 wide, tied embeddings; 16 heads so the
   ALiBi slopes equal bloom-560m's 0.7071 ... 0.0039) is trained on 256-token windows (16 per
   step) cut at random offsets from the token streams of the two corpora, every batch half
   Shakespeare and half Python docs; each window starts at position 0 with no BOS (``--bos``
   puts the BOS token there instead, and the export records ``prepend_bos``). AdamW (betas
   0.9/0.95, weight decay 0.1 on matrices and embeddings only), linear warm-up then cosine decay
   to 10% of the peak (2e-3), gradient clipping 1.0, bf16 autocast. Shape, window, batch, peak
   learning rate and weight decay are options.
3. Every ``--eval-every`` steps: held-out loss on fixed batches of both held-out corpora and the
   BOS mass of every head (mean over query positions t >= 1 of the attention on position 0),
   written to ``log.csv`` and stdout, followed by an atomic checkpoint (``--resume`` continues).
4. At the end: float16 safetensors Hugging Face export with tokenizer, ``headsurgeon.json``
   and ``training_log.csv`` (a copy of ``log.csv``); ``bos_mass.csv`` (final per-head BOS
   masses) in the run directory; the export is reloaded offline and made to generate text.

ALiBi variants (``--bias standard|clamped|log|robust``, with ``--bias-c`` / ``--robust-context``):
every variant, ``standard`` included, is trained through the same pre-hook on each attention
layer (``headsurgeon.exact_alibi.install_hf_bias``) with the bias the mitigations use at
inference (``headsurgeon.alibi.bias_from_distance``); ``headsurgeon.json`` records it under
``alibi`` and ``headsurgeon.load_model`` applies it. ``--retrieval-share F`` makes a share F of
every batch passkey and needle documents built from the train corpora with the evaluation's
templates (``headsurgeon.evals``), answer at the end of the window; the rest is the corpus mix.

Training numerics (issue 49): ``--bias-form absolute`` trains standard ALiBi through
``transformers``' own BLOOM bias (slope x key position, no hook), as Megatron-DeepSpeed trained
BLOOM; ``--precision float32`` turns autocast off (default bfloat16: the bias and q, k cast to
bfloat16 inside ``baddbmm``, the softmax in float32, its weights back to bfloat16). Before the
first step ``check_attention_numerics`` compares layer 0's weights with the same weights formed
by hand from those numerics, bit for bit, and the export records them in ``headsurgeon.json``
as ``training_numerics``. The arms of ``figures/training_numerics/``: see
``analyses/training_numerics.py``.

Natural collapse (issue 29): ``--span-share F`` puts one synthetic span of ``F`` of the window's
text tokens into every training text window at a random point (``Spans``: a seeded Markov chain
over 256 ordinary tokens, 4 successors each, so a span's next token needs no context, except
after its 8 backcopy triggers, which are followed by the token before them; Guo et al. 2024's
Bigram-Backcopy). Held-out evaluation stays text only (what the census reads); ``log.csv`` has
one ``bos_L{l}H{h}`` column per head (held-out text) and the largest BOS mass on the same text
with spans (``max_bos_mass_spans``). ``--stop-at sink|dead`` ends training once the largest
held-out BOS mass has been above 0.5 / 0.95 in ``--stop-evals`` evaluations in a row. The
export's ``headsurgeon.json`` records its census (``census``: the classify CLI's default
census, the labels of the heads that are not healthy). ``--bias clamped --bias-c 1e-6`` is the
recipe without positional bias (every ALiBi logit within 1e-6 of 0): the causal control.

Schedule length: with ``--steps N`` the cosine schedule spans N steps. Without it, steps
``TIMING_STEPS`` (still in warm-up, whose learning rate does not depend on the length) are
timed, together with the step-0 evaluation, and the length is set so that training fits in
``--minutes``. In both cases ``--minutes`` is a hard stop on the total training time (summed
over resumed runs); the planned length is stored in the checkpoint.

The bundled organisms were made with::

    python analyses/train_organism.py --steps 3000 --minutes 85 --out runs/organism \\
        --export headsurgeon/organisms/organism
    python analyses/train_organism.py --steps 1250 --minutes 100 --eval-every 100 \\
        --n-layer 8 --n-head 24 --hidden 192 --seq-len 512 --batch 8 --lr 3e-3 --bos \\
        --name organism-deep --out runs/organism-deep --export headsurgeon/organisms/organism-deep

The runs of ``figures/natural_collapse/`` (neither crossed the sink threshold, so neither is
bundled as ``organism-collapsed``; 22.0 and 6.7 minutes on one thread of a shared machine)::

    python analyses/train_organism.py --minutes 22 --eval-every 200 --n-layer 2 --n-head 8 \\
        --hidden 128 --seq-len 128 --batch 16 --lr 3e-3 --bos --span-share 0.38 \\
        --stop-at sink --stop-evals 5 --name organism-collapsed --out runs/collapsed \\
        --export analyses/collapse_alibi
    python analyses/train_organism.py --minutes 7 --eval-every 200 --n-layer 2 --n-head 8 \\
        --hidden 128 --seq-len 128 --batch 16 --lr 3e-3 --bos --span-share 0.38 \\
        --bias clamped --bias-c 1e-6 --stop-at sink --stop-evals 5 --name collapse-control \\
        --out runs/collapse-control --export analyses/collapse_control

The models of ``figures/mitigation_training/`` (issue 16; shipped in
``analyses/mitigation_models/``), one per ``BIAS`` in standard, log::

    python analyses/train_organism.py --steps 6000 --minutes 40 --n-layer 4 --n-head 8 \
        --hidden 128 --seq-len 128 --batch 16 --bias BIAS --retrieval-share 0.25 \
        --eval-every 500 --name organism-128-BIAS --out runs/mt-BIAS \
        --export analyses/mitigation_models/BIAS
"""

from __future__ import annotations

import argparse
import copy
import csv
import gzip
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BloomConfig,
    BloomForCausalLM,
    PreTrainedTokenizerFast,
)

from headsurgeon import classify_heads, load_model, run_census
from headsurgeon.alibi import check_bias_params, slopes as alibi_slopes
from headsurgeon.allocator import keep_freed_memory
from headsurgeon.evals.retrieval import (
    NEEDLE_QUESTION,
    NEEDLE_SENTENCE,
    NEEDLE_WORDS,
    PASSKEY_INTRO,
    PASSKEY_NEEDLE,
    PASSKEY_QUESTION,
)
from headsurgeon.exact_alibi import TRAINABLE_BIASES, install_hf_bias

log = logging.getLogger("train_organism")

ROOT = Path(__file__).resolve().parent.parent
CORPORA = ROOT / "headsurgeon" / "corpora"
DOMAINS = ("shakespeare", "python-docs")
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
VOCAB_SIZE = 4096
BOS_ID = 1
MIN_LR_FRACTION = 0.1
WARMUP_STEPS = 200
GRAD_CLIP = 1.0
TIMING_STEPS = (10, 40)  # steps timed (after a few warm-up steps) to plan the schedule
EVAL_SEQS = 16  # per held-out corpus
BOS_SEQS = 4  # per held-out corpus
EXPORT_LIMIT_BYTES = 10 * 1024 * 1024
# Synthetic spans (--span-share): a seeded Markov chain over SPAN_ALPHABET ordinary tokens, each
# with SPAN_SUCCESSORS equally likely successors (its next token needs no context), and
# SPAN_TRIGGERS of those tokens are triggers, followed by the token before them instead
# (Guo et al. 2024's Bigram-Backcopy, arXiv:2410.13835: the one place a span needs attention).
SPAN_ALPHABET = 256
SPAN_SUCCESSORS = 4
SPAN_TRIGGERS = 8
SINK_THRESHOLD = 0.5  # headsurgeon.classify's BOS-sink and dead thresholds
DEAD_THRESHOLD = 0.95
BIAS_FORMS = ("relative", "absolute")
# What CPU autocast does to transformers' BLOOM attention (checked by check_attention_numerics):
# baddbmm casts the float32 bias, q and k to bfloat16 and returns bfloat16 scores; the softmax
# runs in float32 and its weights are cast back to the queries' bfloat16.
PRECISIONS = {"bfloat16": torch.bfloat16, "float32": torch.float32}
LOG_FIELDS = [
    "step",
    "tokens",
    "lr",
    "train_loss",
    "heldout_shakespeare",
    "heldout_python_docs",
    "max_bos_mass",
    "max_bos_head",
    "max_bos_mass_spans",
    "max_bos_head_spans",
    "minutes",
]  # then per head a bos_L{layer}H{head} column (its BOS mass on the held-out text windows) and a
# sink_L{layer}H{head} column (its sink score, Gu et al.'s alpha_1, on the same windows)


@dataclass
class Spans:
    """The synthetic span language: ``successors[i]`` are the tokens that may follow
    ``alphabet[i]``; a token of ``triggers`` is followed by the token before it."""

    alphabet: torch.Tensor  # (SPAN_ALPHABET,) token ids
    successors: torch.Tensor  # (SPAN_ALPHABET, SPAN_SUCCESSORS) token ids
    triggers: torch.Tensor  # (SPAN_TRIGGERS,) token ids, a subset of alphabet

    @classmethod
    def build(cls, seed: int) -> Spans:
        """The span language of ``seed``: ordinary (non-special) tokens only."""
        g = torch.Generator().manual_seed(seed)
        n_special = len(SPECIAL_TOKENS)
        alphabet = n_special + torch.randperm(VOCAB_SIZE - n_special, generator=g)[:SPAN_ALPHABET]
        successors = alphabet[
            torch.randint(0, SPAN_ALPHABET, (SPAN_ALPHABET, SPAN_SUCCESSORS), generator=g)
        ]
        return cls(alphabet, successors, alphabet[:SPAN_TRIGGERS])

    def sample(self, length: int, gen: torch.Generator) -> torch.Tensor:
        """One span of ``length`` tokens starting at a random non-trigger token."""
        index = {t: i for i, t in enumerate(self.alphabet.tolist())}
        trigger = set(self.triggers.tolist())
        first = int(torch.randint(SPAN_TRIGGERS, SPAN_ALPHABET, (1,), generator=gen))
        tokens = [int(self.alphabet[first])]
        draws = torch.randint(0, SPAN_SUCCESSORS, (length,), generator=gen).tolist()
        while len(tokens) < length:
            current = tokens[-1]
            if current in trigger and len(tokens) >= 2:
                tokens.append(tokens[-2])
            else:
                tokens.append(int(self.successors[index[current], draws[len(tokens)]]))
        return torch.tensor(tokens, dtype=torch.long)


@dataclass
class Data:
    """Token streams of the train corpora and fixed held-out windows."""

    train: dict[str, torch.Tensor]
    heldout: dict[str, torch.Tensor]  # (EVAL_SEQS, seq_len) per domain
    seq_len: int
    bos: bool  # every window starts with BOS_ID (and holds seq_len - 1 text tokens)
    spans: Spans | None = None  # with span_len > 0: every training text window holds one span
    span_len: int = 0
    heldout_spans: dict[str, torch.Tensor] = field(default_factory=dict)  # (BOS_SEQS, seq_len)

    def window(self, stream: torch.Tensor, start: int) -> torch.Tensor:
        """The (text-only) window of ``stream`` starting at ``start``."""
        if not self.bos:
            return stream[start : start + self.seq_len]
        text = stream[start : start + self.seq_len - 1]
        return torch.cat([torch.tensor([BOS_ID]), text])

    def mixed_window(self, stream: torch.Tensor, start: int, gen: torch.Generator) -> torch.Tensor:
        """A training window: text of ``stream`` from ``start`` with one synthetic span of
        ``span_len`` tokens inserted at a random point (BOS first with ``bos``)."""
        if not self.span_len:
            return self.window(stream, start)
        assert self.spans is not None
        n_text = self.seq_len - self.bos - self.span_len
        text = stream[start : start + n_text]
        cut = int(torch.randint(0, n_text + 1, (1,), generator=gen))
        head = [torch.tensor([BOS_ID])] if self.bos else []
        span = self.spans.sample(self.span_len, gen)
        return torch.cat([*head, text[:cut], span, text[cut:]])


def read_corpus(name: str) -> str:
    """Read one bundled corpus, e.g. ``shakespeare-train``."""
    with gzip.open(CORPORA / f"{name}.txt.gz", "rt", encoding="utf-8") as f:
        return f.read()


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Train a BLOOM-style byte-level BPE tokenizer (no BOS added, no prefix space)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="left",
    )


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> torch.Tensor:
    """Encode a whole corpus into a 1-D token stream."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def load_data(
    tokenizer: PreTrainedTokenizerFast,
    seq_len: int,
    bos: bool,
    span_share: float = 0.0,
    seed: int = 0,
) -> Data:
    """Tokenize the train streams and cut ``EVAL_SEQS`` evenly spaced held-out windows (text
    only, as the census reads them). ``span_share`` of every training text window's tokens are a
    synthetic span (:class:`Spans` of ``seed``)."""
    span_len = round(span_share * (seq_len - bos))
    if not 0 <= span_len < seq_len - bos:
        raise ValueError(f"--span-share {span_share} leaves no text in a {seq_len}-token window")
    data = Data(
        train={d: encode(tokenizer, read_corpus(f"{d}-train")) for d in DOMAINS},
        heldout={},
        seq_len=seq_len,
        bos=bos,
        spans=Spans.build(seed) if span_len else None,
        span_len=span_len,
    )
    span_gen = torch.Generator().manual_seed(seed + 2)
    for d in DOMAINS:
        stream = encode(tokenizer, read_corpus(f"{d}-heldout"))
        stride = (len(stream) - seq_len) // (EVAL_SEQS - 1)
        data.heldout[d] = torch.stack([data.window(stream, i * stride) for i in range(EVAL_SEQS)])
        if span_len:  # the same held-out text with spans: BOS mass where the spans are
            data.heldout_spans[d] = torch.stack(
                [data.mixed_window(stream, i * stride, span_gen) for i in range(BOS_SEQS)]
            )
        log.info("%s: %d train tokens", d, len(data.train[d]))
    return data


def sample_batch(
    data: Data,
    gen: torch.Generator,
    batch: int,
    tokenizer: PreTrainedTokenizerFast | None = None,
    retrieval: int = 0,
) -> torch.Tensor:
    """A (batch, seq_len) batch: ``retrieval`` passkey/needle documents, the rest half from each
    domain at random offsets."""
    rows = [retrieval_window(data, tokenizer, gen) for _ in range(retrieval)]
    text_rows = batch - retrieval
    for i, d in enumerate(DOMAINS):
        n = text_rows // len(DOMAINS) + (i < text_rows % len(DOMAINS))
        starts = torch.randint(0, len(data.train[d]) - data.seq_len, (n,), generator=gen)
        rows += [data.mixed_window(data.train[d], s, gen) for s in starts.tolist()]
    return torch.stack(rows)


def retrieval_window(
    data: Data, tokenizer: PreTrainedTokenizerFast, gen: torch.Generator
) -> torch.Tensor:
    """One training document of the evaluation's retrieval tasks (headsurgeon.evals' templates),
    exactly ``seq_len`` tokens ending with the answer: a passkey (random 5-digit number) or a
    needle (a word of NEEDLE_WORDS) hidden at a random depth of train-corpus filler, then the
    question. The evaluation uses held-out filler; the tasks are otherwise the same."""

    def draw(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=gen))

    if draw(2) == 0:
        key = str(10_000 + draw(90_000))
        intro, needle, question = PASSKEY_INTRO, PASSKEY_NEEDLE.format(key=key), PASSKEY_QUESTION
    else:
        key = NEEDLE_WORDS[draw(len(NEEDLE_WORDS))]
        intro, needle, question = "", NEEDLE_SENTENCE.format(key=key), NEEDLE_QUESTION
    head = [BOS_ID] if data.bos else []
    parts = [encode(tokenizer, t).tolist() for t in (intro, needle, question, " " + key)]
    n_filler = data.seq_len - len(head) - sum(map(len, parts))
    if n_filler < 0:
        raise ValueError(f"--seq-len {data.seq_len} is too short for a retrieval document")
    stream = data.train[DOMAINS[draw(len(DOMAINS))]]
    start = draw(len(stream) - n_filler)
    filler = stream[start : start + n_filler].tolist()
    cut = draw(n_filler + 1)  # the needle's depth
    tokens = head + parts[0] + filler[:cut] + parts[1] + filler[cut:] + parts[2] + parts[3]
    return torch.tensor(tokens, dtype=torch.long)


def bias_params(args: argparse.Namespace) -> dict:
    """The ALiBi variant's parameters, checked (headsurgeon.alibi.check_bias_params)."""
    params = {}
    if args.bias == "clamped":
        params["c"] = args.bias_c
    if args.bias == "robust":
        params["context"] = args.robust_context or args.seq_len
    if args.bias == "log" and args.log_match:
        params["match"] = args.log_match
    return check_bias_params(args.bias, **params)


def lr_at(step: int, total: int, peak: float, warmup: int = WARMUP_STEPS) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``MIN_LR_FRACTION``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)


def build_model(args: argparse.Namespace) -> BloomForCausalLM:
    """A freshly initialised BLOOM with the requested shape."""
    config = BloomConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden,
        n_layer=args.n_layer,
        n_head=args.n_head,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=True,
    )
    return BloomForCausalLM(config)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (incl. the tied embedding) only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
    )


def bos_masses(model: BloomForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (n_layer, n_head) BOS masses of ``ids`` (mean over windows and queries t >= 1 of the
    attention on position 0: the census's ``bos_mass``) and sink scores (the same mean over every
    query row, row 0 included: Gu et al. 2025's alpha_1, the census's ``sink_score``)."""
    attentions = model(input_ids=ids, output_attentions=True).attentions
    # (layer, batch, head, query, key) -> mean over batch and queries of key 0
    first = [a[:, :, :, 0].float() for a in attentions]
    bos = torch.stack([f[:, :, 1:].mean(dim=(0, 2)) for f in first])
    sink = torch.stack([f.mean(dim=(0, 2)) for f in first])
    return bos, sink


@torch.no_grad()
def evaluate(
    model: BloomForCausalLM, data: Data, precision: str
) -> tuple[dict[str, float], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Held-out loss per domain (in the training's ``precision``), the (n_layer, n_head)
    BOS-mass and sink-score matrices on held-out text and, with spans, the BOS masses on the
    same text with spans (else None)."""
    model.eval()
    losses = {}
    for d in DOMAINS:
        with autocast(precision):
            out = model(input_ids=data.heldout[d], labels=data.heldout[d])
        losses[d] = out.loss.item()
    bos, sink = bos_masses(model, torch.cat([data.heldout[d][:BOS_SEQS] for d in DOMAINS]))
    spans = None
    if data.heldout_spans:
        spans, _ = bos_masses(model, torch.cat([data.heldout_spans[d] for d in DOMAINS]))
    model.train()
    return losses, bos, sink, spans


def head_name(flat: int, n_head: int) -> str:
    """``L{layer}H{head}`` of a flat head index."""
    return f"L{flat // n_head}H{flat % n_head}"


def should_stop(history: list[float], threshold: float, evals: int) -> bool:
    """Whether the largest BOS mass was above ``threshold`` in each of the last ``evals``
    evaluations (one crossing could be noise of the 8 evaluation windows).

    >>> should_stop([0.2, 0.51, 0.6], 0.5, 2), should_stop([0.51, 0.4, 0.6], 0.5, 2)
    (True, False)
    """
    return len(history) >= evals and all(m > threshold for m in history[-evals:])


def autocast(precision: str) -> torch.autocast:
    """CPU autocast to bfloat16 for ``--precision bfloat16``, else a disabled one."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16")


@torch.no_grad()
def check_attention_numerics(model: BloomForCausalLM, args: argparse.Namespace) -> dict:
    """The attention numerics the training runs under, checked bit for bit on one window: the
    first layer's weights as transformers computes them (under ``--precision``, with the
    ``--bias-form`` bias) against the same weights formed by hand from the recorded numerics.
    Returns the ``training_numerics`` record of ``headsurgeon.json``."""
    dtype = PRECISIONS[args.precision]
    ids = torch.arange(4, 4 + min(args.seq_len, 64))[None]
    attention = model.transformer.h[0].self_attention
    captured = {}

    def grab(module, args_, kwargs):
        captured.update(kwargs, hidden=args_[0] if args_ else kwargs["hidden_states"])

    # Registered last: it sees the bias the attention receives (after the bias hook, if any).
    handle = attention.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with autocast(args.precision):
            weights = model(input_ids=ids, output_attentions=True).attentions[0]
    finally:
        handle.remove()
    with autocast(args.precision):
        q, k, _ = attention._reshape(attention.query_key_value(captured["hidden"]))
    n_heads, n = q.shape[1], ids.shape[1]
    alibi = captured["alibi"].view(n_heads, -1, n)  # [head, 1 (absolute) or query, key]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if args.bias == "standard":  # the form recorded is the form handed to the attention
        slopes = alibi_slopes(n_heads).float()
        distance = torch.arange(n)[None, :] - torch.arange(n)[:, None]  # j - i
        position = torch.arange(n).expand(n, n)
        form = slopes[:, None, None] * (distance if args.bias_form == "relative" else position)
        if not torch.equal(alibi.expand(n_heads, n, n)[:, causal], form[:, causal]):
            raise RuntimeError(
                f"the bias handed to the attention is not --bias-form {args.bias_form}"
            )
    scores = alibi.to(dtype).baddbmm(
        q[0].to(dtype), k[0].to(dtype).transpose(-1, -2), alpha=1 / math.sqrt(q.shape[-1])
    )
    scores = scores.float().masked_fill(~causal, -math.inf)
    expected = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    if weights.dtype != dtype or not torch.equal(weights[0], expected):
        raise RuntimeError(
            f"transformers' attention under --precision {args.precision} does not compute as "
            f"recorded (largest difference {(weights[0].float() - expected).abs().max():.3g})"
        )
    return {
        "bias": args.bias_form,
        "scores_dtype": args.precision,
        "softmax_dtype": "float32",
        "source": "analyses/train_organism.py: transformers' BLOOM attention"
        + (" under CPU autocast to bfloat16" if args.precision == "bfloat16" else " in float32")
        + (
            ", the bias hook's relative bias"
            if args.bias_form == "relative"
            else ", its own absolute bias (slope x key position)"
        )
        + "; checked bit for bit at the start of training",
    }


def atomic_save(obj: object, path: Path) -> None:
    """``torch.save`` to a temp file, then ``os.replace``."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_bos_csv(bos: torch.Tensor, path: Path) -> None:
    """Per-head BOS masses as ``layer,head,bos_mass`` rows."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "head", "bos_mass"])
        for (layer, head), v in zip(
            torch.cartesian_prod(torch.arange(bos.shape[0]), torch.arange(bos.shape[1])).tolist(),
            bos.flatten().tolist(),
            strict=True,
        ):
            w.writerow([layer, head, f"{v:.6f}"])
    os.replace(tmp, path)


def export(
    model: BloomForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    out: Path,
    meta: dict,
) -> None:
    """Save a float16 safetensors HF checkpoint, the tokenizer and ``headsurgeon.json``."""
    out.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).half().save_pretrained(out)  # v5: always safetensors
    tokenizer.save_pretrained(out)
    special = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    (out / "headsurgeon.json").write_text(json.dumps(meta, indent=2) + "\n")


def verify_export(out: Path, bos: bool, bias: dict) -> str:
    """Reload the export offline, check its size and return a short greedy generation."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    if size > EXPORT_LIMIT_BYTES:
        raise RuntimeError(f"export is {size:,d} bytes > {EXPORT_LIMIT_BYTES:,d}")
    model = AutoModelForCausalLM.from_pretrained(out)
    install_hf_bias(model, bias["kind"], **bias["params"])  # as headsurgeon.load_model does
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = "To be, or not to be"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    if ids[0, 0].item() == tokenizer.bos_token_id:
        raise RuntimeError("exported tokenizer prepends BOS; BLOOM's does not")
    if bos:
        ids = torch.cat([torch.tensor([[BOS_ID]]), ids], dim=1)
    gen = model.generate(ids, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(gen[0])
    log.info("export %s: %.2f MB, sample: %r", out, size / 1e6, text)
    return text


def census_record(out: Path) -> dict:
    """What ``python -m headsurgeon classify`` says of the export (its default census: 64
    held-out windows of 128 tokens): the label of every head that is not healthy, and the
    largest BOS mass. Recorded in ``headsurgeon.json`` so that the claim can be checked."""
    census = classify_heads(run_census(load_model(str(out)), progress=False))
    sick = census[census["label"] != "healthy"]
    return {
        "n_seqs": census.attrs["n_seqs"],
        "seq_len": census.attrs["seq_len"],
        "labels": {f"L{r.layer}H{r.head}": r.label for r in sick.itertuples()},
        "max_bos_mass": round(float(census["bos_mass"].max()), 4),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=65.0, help="hard training-time budget")
    p.add_argument("--steps", type=int, default=None, help="schedule length (default: planned)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "organism", help="run directory")
    p.add_argument("--export", type=Path, default=ROOT / "headsurgeon" / "organisms" / "organism")
    p.add_argument("--name", default="organism", help="organism name for headsurgeon.json")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training window")
    p.add_argument("--batch", type=int, default=16, help="windows per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="linear warm-up")
    p.add_argument(
        "--bos",
        action="store_true",
        help="start every window with the BOS token (default: text from position 0, as BLOOM)",
    )
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument(
        "--bias",
        choices=TRAINABLE_BIASES,
        default="standard",
        help="ALiBi variant trained with (headsurgeon.alibi.bias_from_distance; the mitigations' "
        "own definitions); recorded in headsurgeon.json and applied by headsurgeon.load_model",
    )
    p.add_argument("--bias-c", type=float, help="clamped: the bias floor (bias >= -c)")
    p.add_argument(
        "--robust-context", type=int, help="robust: context kept sighted (default --seq-len)"
    )
    p.add_argument(
        "--log-match",
        type=int,
        help="log: slopes rescaled so the penalty at this distance equals standard ALiBi's",
    )
    p.add_argument(
        "--retrieval-share",
        type=float,
        default=0.0,
        help="share of each batch that is passkey/needle documents (headsurgeon.evals' tasks)",
    )
    p.add_argument(
        "--span-share",
        type=float,
        default=0.0,
        help="share of every training text window that is one synthetic span (Spans: a Markov "
        "chain whose next token needs no context, with backcopy triggers); 0: text only",
    )
    p.add_argument(
        "--stop-at",
        choices=("none", "sink", "dead"),
        default="none",
        help=f"stop once the largest held-out BOS mass is above the sink ({SINK_THRESHOLD}) or "
        f"dead ({DEAD_THRESHOLD}) threshold in --stop-evals evaluations in a row",
    )
    p.add_argument("--stop-evals", type=int, default=3, help="evaluations in a row for --stop-at")
    p.add_argument(
        "--bias-form",
        choices=BIAS_FORMS,
        default="relative",
        help="relative: the bias hook's -m (i - j) (every --bias); absolute: transformers' own "
        "BLOOM bias, slope x key position, as Megatron-DeepSpeed trained BLOOM (--bias standard)",
    )
    p.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default="bfloat16",
        help="bfloat16: CPU autocast (bias cast to bfloat16 inside baddbmm, scores in bfloat16, "
        "softmax float32, weights back to bfloat16); float32: no autocast",
    )
    args = p.parse_args()
    if args.bias_form == "absolute" and args.bias != "standard":
        p.error("--bias-form absolute is transformers' own standard ALiBi: use --bias standard")
    return args


def main() -> None:
    keep_freed_memory()  # attention-sized buffers stay mapped: each step ~1.5x faster
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "checkpoint.pt"
    tok_dir = args.out / "tokenizer"

    if args.resume:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    else:
        t0 = time.perf_counter()
        tokenizer = train_tokenizer([read_corpus(f"{d}-train") for d in DOMAINS])
        tokenizer.save_pretrained(tok_dir)
        log.info("tokenizer trained in %.1f s", time.perf_counter() - t0)
    data = load_data(tokenizer, args.seq_len, args.bos, args.span_share, args.seed)

    model = build_model(args)
    bias = {"kind": args.bias, "params": bias_params(args)}
    if args.bias_form == "relative":  # every variant through the same hook
        install_hf_bias(model, bias["kind"], **bias["params"])
    numerics = check_attention_numerics(model, args)
    n_retrieval = round(args.batch * args.retrieval_share)
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed + 1)
    step, tokens_seen, elapsed, total_steps = 0, 0, 0.0, args.steps
    if args.resume:
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        step, tokens_seen = state["step"], state["tokens_seen"]
        elapsed, total_steps = state["elapsed_s"], state["total_steps"]
        log.info("resumed at step %d (%.1f min trained)", step, elapsed / 60)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %s, %.2fM parameters", args, n_params / 1e6)

    log_path = args.out / "log.csv"
    new_log = not (args.resume and log_path.exists())
    log_file = open(log_path, "w" if new_log else "a", newline="")
    heads = [head_name(i, args.n_head) for i in range(args.n_layer * args.n_head)]
    head_columns = [f"bos_{h}" for h in heads]
    sink_columns = [f"sink_{h}" for h in heads]
    writer = csv.DictWriter(log_file, fieldnames=LOG_FIELDS + head_columns + sink_columns)
    if new_log:
        writer.writeheader()

    budget = args.minutes * 60
    train_losses: list[float] = []
    eval_seconds = 0.0
    last_eval: tuple[int, dict[str, float], torch.Tensor] | None = None
    threshold = {"none": math.inf, "sink": SINK_THRESHOLD, "dead": DEAD_THRESHOLD}[args.stop_at]
    max_history: list[float] = []

    def log_eval() -> None:
        nonlocal eval_seconds, last_eval
        t = time.perf_counter()
        losses, bos, sink, span_bos = evaluate(model, data, args.precision)
        eval_seconds = time.perf_counter() - t
        max_history.append(bos.max().item())
        planned = total_steps or args.warmup_steps
        row = {
            "step": step,
            "tokens": tokens_seen,
            "lr": f"{lr_at(step, planned, args.lr, args.warmup_steps):.3e}",
            "train_loss": f"{sum(train_losses) / len(train_losses):.4f}" if train_losses else "",
            "heldout_shakespeare": f"{losses['shakespeare']:.4f}",
            "heldout_python_docs": f"{losses['python-docs']:.4f}",
            "max_bos_mass": f"{bos.max().item():.4f}",
            "max_bos_head": head_name(int(bos.argmax()), args.n_head),
            "max_bos_mass_spans": "" if span_bos is None else f"{span_bos.max().item():.4f}",
            "max_bos_head_spans": ""
            if span_bos is None
            else head_name(int(span_bos.argmax()), args.n_head),
            "minutes": f"{elapsed / 60:.2f}",
        }
        for columns, values in ((head_columns, bos), (sink_columns, sink)):
            row.update(
                {c: f"{v:.4f}" for c, v in zip(columns, values.flatten().tolist(), strict=True)}
            )
        writer.writerow(row)
        log_file.flush()
        log.info(" ".join(f"{k}={row[k]}" for k in LOG_FIELDS))
        train_losses.clear()
        last_eval = (step, losses, bos)

    def checkpoint() -> None:
        atomic_save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "data_rng": gen.get_state(),
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
                "step": step,
                "tokens_seen": tokens_seen,
                "elapsed_s": elapsed,
                "total_steps": total_steps,
                "args": vars(args),
            },
            ckpt_path,
        )

    model.train()
    if step == 0:
        log_eval()
    timing_start = 0.0
    stopped = ""
    while elapsed < budget and (total_steps is None or step < total_steps):
        t = time.perf_counter()
        lr = lr_at(step, total_steps or args.warmup_steps, args.lr, args.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(data, gen, args.batch, tokenizer, n_retrieval)
        with autocast(args.precision):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_losses.append(loss.item())
        step += 1
        tokens_seen += batch.numel()
        elapsed += time.perf_counter() - t
        if step == TIMING_STEPS[0]:
            timing_start = time.perf_counter()
        if total_steps is None and step == TIMING_STEPS[1]:
            step_s = (time.perf_counter() - timing_start) / (TIMING_STEPS[1] - TIMING_STEPS[0])
            per_step = step_s + eval_seconds / args.eval_every
            total_steps = step + int((budget - elapsed) / per_step)
            log.info("%.3f s/step; planned schedule: %d steps", step_s, total_steps)
        if step % args.eval_every == 0:
            t = time.perf_counter()
            log_eval()
            checkpoint()
            elapsed += time.perf_counter() - t
            if should_stop(max_history, threshold, args.stop_evals):
                stopped = f"largest BOS mass above {threshold} in {args.stop_evals} evaluations"
                log.info("stopping at step %d: %s", step, stopped)
                break

    if last_eval is None or last_eval[0] != step:
        log_eval()
        checkpoint()
    log_file.close()
    assert last_eval is not None
    _, losses, bos = last_eval
    write_bos_csv(bos, args.out / "bos_mass.csv")

    meta = {
        "name": args.name,
        "prepend_bos": args.bos,
        "alibi": bias,
        "training_numerics": numerics,
        "description": (
            f"{args.n_layer}-layer, {args.n_head}-head, {args.hidden}-wide BLOOM "
            f"({args.bias} ALiBi) "
            "trained from scratch on CPU by analyses/train_organism.py on a 50/50 mix of "
            f"Shakespeare and the Python documentation in {args.seq_len}-token windows "
            f"({args.retrieval_share:.0%} passkey/needle documents; "
            f"{data.span_len} tokens of every text window a synthetic span); "
            "byte-level BPE vocab 4096, "
            + ("every window starting with BOS." if args.bos else "no BOS.")
        ),
        "training": {
            "config": {
                "n_layer": args.n_layer,
                "n_head": args.n_head,
                "hidden_size": args.hidden,
                "vocab_size": VOCAB_SIZE,
                "seq_len": args.seq_len,
                "batch": args.batch,
                "peak_lr": args.lr,
                "warmup_steps": args.warmup_steps,
                "weight_decay": args.weight_decay,
                "parameters": n_params,
                "retrieval_share": args.retrieval_share,
                "span_share": args.span_share,
                "span_len": data.span_len,
            },
            "stopped": stopped or "schedule or --minutes budget ended",
            "steps": step,
            "planned_steps": total_steps,
            "tokens_seen": tokens_seen,
            "final_heldout_loss": {d: round(v, 4) for d, v in losses.items()},
            "max_bos_mass": round(bos.max().item(), 4),
            "minutes": round(elapsed / 60, 2),
            "seed": args.seed,
        },
        "corpus": [
            {
                "name": d,
                "train": f"headsurgeon/corpora/{d}-train.txt.gz",
                "heldout": f"headsurgeon/corpora/{d}-heldout.txt.gz",
            }
            for d in DOMAINS
        ],
    }
    export(model, tokenizer, args.export, meta)
    shutil.copyfile(log_path, args.export / "training_log.csv")
    verify_export(args.export, args.bos, bias)
    meta["census"] = census_record(args.export)
    log.info("census of the export: %s", meta["census"])
    (args.export / "headsurgeon.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
