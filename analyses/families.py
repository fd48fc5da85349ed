"""Every model family on the installed TransformerLens major: exact against `transformers`, or
refused in one line.

For each family (BLOOM, MPT and Falcon with ALiBi, GPT-2, GPT-NeoX, Llama with grouped-query
attention, OPT) a tiny random checkpoint (2 layers, 4 heads, 64 wide, vocabulary 128, float32,
seed 0) is built offline with ``transformers`` and saved with ``save_pretrained``, loaded with
``headsurgeon.load_model(folder)``, and every analysis is checked against a brute force computed
from the same Hugging Face model with eager attention (``output_attentions=True``, and a
forward pre-hook on each layer's attention output projection for the heads' outputs):

* census: every column of ``run_census`` (2 sequences x 256 tokens, dense; ALiBi models also in
  blocks of 64 query rows) against the same statistics of the eager patterns and head outputs
  (the error relative where a value exceeds 1);
* blindness: ``measure_blindness`` zero counts per head and dtype (``hf`` convention, 1 x 512
  tokens) against the entries of the float32 eager pattern that the dtype rounds to 0;
* importance: ``head_importance(method="zero")`` against the eager loss with that head's slice
  of the output projection's input zeroed;
* repair: one pass of ``repair`` forced on L0H0 (4 fine-tuning steps): the largest change of any
  weight outside the head's slices (0 when the frozen weights are bit-identical), the head
  changed;
* export: ``save_hf``, reloaded with ``transformers``: largest logit gap to the model.

A cell is "exact (max error e)" within tolerance, "refused: <the one line>" when the call raises
a ``headsurgeon.errors`` exception, and "MISMATCH" or "FAILED" otherwise (a bug). Run it under
each TransformerLens major; each writes ``figures/families/tl<major>/``.

    python analyses/families.py            # ~2 min on one thread
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import transformers as tf
from _common import markdown, parser, start, write_topic
from torch import nn

import headsurgeon as hs
from headsurgeon.backend import MAJOR
from headsurgeon.blindness import ANALYSED_DTYPES
from headsurgeon.errors import HeadsurgeonError
from headsurgeon.finetune import FinetuneConfig
from headsurgeon.repair import RepairConfig, repair
from headsurgeon.surgery import head_masks

VOCAB, HEADS, WIDTH, LAYERS = 128, 4, 64, 2
CENSUS_SHAPE, BLINDNESS_LEN = (2, 256), 512
TOLERANCE = {"census": 1e-5, "blindness": 0, "importance": 1e-5, "repair": 0, "export": 1e-4}


def _configs() -> dict[str, tuple[tf.PretrainedConfig, Callable[[nn.Module, int], nn.Module]]]:
    """Family -> (config, the attention output projection of layer i of its causal LM)."""
    n = 2 * BLINDNESS_LEN  # learned and rotary positions: room for every length used
    return {
        "BLOOM": (
            tf.BloomConfig(hidden_size=WIDTH, n_head=HEADS, n_layer=LAYERS, vocab_size=VOCAB),
            lambda m, i: m.transformer.h[i].self_attention.dense,
        ),
        "MPT": (
            tf.MptConfig(
                d_model=WIDTH,
                n_heads=HEADS,
                n_layers=LAYERS,
                vocab_size=VOCAB,
                max_seq_len=n,
                attn_config={"alibi": True, "alibi_bias_max": 16},
            ),
            lambda m, i: m.transformer.blocks[i].attn.out_proj,
        ),
        "Falcon (ALiBi)": (
            tf.FalconConfig(
                hidden_size=WIDTH,
                num_attention_heads=HEADS,
                num_hidden_layers=LAYERS,
                vocab_size=VOCAB,
                alibi=True,
                new_decoder_architecture=False,
                multi_query=False,
                parallel_attn=False,
                bias=True,
            ),
            lambda m, i: m.transformer.h[i].self_attention.dense,
        ),
        # n_ctx as published GPT-2 configs have it (transformers 5 no longer writes it).
        "GPT-2": (
            tf.GPT2Config(
                n_embd=WIDTH, n_head=HEADS, n_layer=LAYERS, vocab_size=VOCAB, n_positions=n, n_ctx=n
            ),
            lambda m, i: m.transformer.h[i].attn.c_proj,
        ),
        "GPT-NeoX": (
            tf.GPTNeoXConfig(
                hidden_size=WIDTH,
                num_attention_heads=HEADS,
                num_hidden_layers=LAYERS,
                intermediate_size=4 * WIDTH,
                vocab_size=VOCAB,
                max_position_embeddings=n,
            ),
            lambda m, i: m.gpt_neox.layers[i].attention.dense,
        ),
        "Llama (GQA 4/2)": (
            tf.LlamaConfig(
                hidden_size=WIDTH,
                num_attention_heads=HEADS,
                num_key_value_heads=HEADS // 2,
                num_hidden_layers=LAYERS,
                intermediate_size=2 * WIDTH,
                vocab_size=VOCAB,
                max_position_embeddings=n,
            ),
            lambda m, i: m.model.layers[i].self_attn.o_proj,
        ),
        "OPT": (
            tf.OPTConfig(
                hidden_size=WIDTH,
                num_attention_heads=HEADS,
                num_hidden_layers=LAYERS,
                ffn_dim=4 * WIDTH,
                vocab_size=VOCAB,
                max_position_embeddings=n,
                word_embed_proj_dim=WIDTH,
            ),
            lambda m, i: m.model.decoder.layers[i].self_attn.out_proj,
        ),
    }


def build(config: tf.PretrainedConfig, folder: Path) -> nn.Module:
    """A random float32 causal LM of ``config`` with eager attention, saved to ``folder``."""
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    hf = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    hf.save_pretrained(folder)
    return hf


# --- the brute force: transformers eager ---------------------------------------------------


def eager(hf: nn.Module, out_proj: Callable, tokens: torch.Tensor, ablate: tuple | None = None):
    """Patterns ``[layer] [batch, head, q, k]``, heads' outputs ``[layer] [batch, pos, head,
    d_model]`` (no bias) and the mean next-token loss, from one eager forward; ``ablate=(layer,
    head)`` zeroes that head's slice of the output projection's input."""
    d_head = WIDTH // HEADS
    writes, handles = [], []
    for i in range(LAYERS):
        proj = out_proj(hf, i)

        def pre(module, args, i=i, proj=proj):
            z = args[0]
            if ablate is not None and ablate[0] == i:
                z = z.clone()
                z[..., ablate[1] * d_head : (ablate[1] + 1) * d_head] = 0
            # Linear: weight [out, in]; GPT-2's Conv1D: weight [in, out].
            w = proj.weight.T if isinstance(proj, nn.Linear) else proj.weight
            zh = z.view(*z.shape[:-1], HEADS, d_head)
            writes.append(torch.einsum("bphd,hdm->bphm", zh, w.view(HEADS, d_head, -1)))
            return (z, *args[1:])

        handles.append(proj.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            out = hf(tokens, output_attentions=True, labels=tokens)
    finally:
        for handle in handles:
            handle.remove()
    return [a.double() for a in out.attentions], [w.double() for w in writes], out.loss.item()


def eager_census(patterns, writes, min_query_pos: int = 1) -> pd.DataFrame:
    """The census columns of each head, computed directly from full patterns and head writes."""
    rows = []
    for layer, (a, w) in enumerate(zip(patterns, writes, strict=True)):
        t = a.shape[-1]
        pos = torch.arange(t, dtype=a.dtype)
        later = a[:, :, min_query_pos:]  # [batch, head, rows, keys]
        distance = (pos[:, None] - pos[None, :]).clamp(min=0)[min_query_pos:]
        per_seq = {
            "bos_mass": later[..., 0].mean(-1),
            "sink_score": a[..., 0].mean(-1),
            "entropy": torch.special.entr(later).sum(-1).mean(-1),
            "max_weight": later.amax(-1).mean(-1),
            "mean_distance": (later * distance).sum(-1).mean(-1),
            "self_mass": later.diagonal(min_query_pos, -2, -1).mean(-1),
            "prev_mass": a[:, :, max(min_query_pos, 1) :]
            .diagonal(max(min_query_pos, 1) - 1, -2, -1)
            .mean(-1),
            "output_norm": w[:, min_query_pos:].norm(dim=-1).mean(1),
        }
        layer_norm = w[:, min_query_pos:].sum(2).norm(dim=-1).mean(1)  # [batch]
        for head in range(HEADS):
            row = {"layer": layer, "head": head}
            row |= {k: v[:, head].mean().item() for k, v in per_seq.items()}
            row["bos_mass_std"] = per_seq["bos_mass"][:, head].std(correction=1).item()
            row["output_share"] = row["output_norm"] / layer_norm.mean().item()
            rows.append(row)
    return pd.DataFrame(rows)


# --- the checks ----------------------------------------------------------------------------


def check_census(model, hf, out_proj, tokens) -> float:
    expected = eager_census(*eager(hf, out_proj, tokens)[:2])
    runs = [hs.run_census(model, tokens, progress=False)]
    if model.cfg.positional_embedding_type == "alibi":
        runs.append(hs.run_census(model, tokens, block_size=64, progress=False))
    errors = []
    for census in runs:
        if len(census) != len(expected):
            raise AssertionError(f"{len(census)} census rows, expected {len(expected)}")
        columns = [c for c in expected.columns if c not in ("layer", "head")]
        got = census[columns].to_numpy(float)
        want = expected[columns].to_numpy(float)
        # Relative above 1: mean distances of hundreds of tokens carry float32's relative error.
        errors.append((np.abs(got - want) / np.maximum(np.abs(want), 1)).max())
    return float(max(errors))


def check_blindness(model, hf, out_proj, tokens) -> float:
    patterns = eager(hf, out_proj, tokens)[0]
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
    measured = hs.measure_blindness(model, tokens, progress=False).by_head
    n_causal = tokens.shape[0] * causal.sum().item()
    gap = 0.0
    for dtype in ANALYSED_DTYPES:
        for layer, a in enumerate(patterns):
            zeros = ((a.float().to(getattr(torch, dtype)) == 0) & causal).sum((0, 2, 3))
            got = measured[(measured["dtype"] == dtype) & (measured["layer"] == layer)]
            got = got.sort_values("head")
            counts = np.rint(got["zero_fraction"].to_numpy() * n_causal)
            gap = max(gap, float(np.abs(counts - zeros.numpy()).max()))
    return gap


def check_importance(model, hf, out_proj, tokens) -> float:
    got = hs.head_importance(model, tokens, method="zero", progress=False)
    clean = eager(hf, out_proj, tokens)[2]
    gap = 0.0
    for row in got.itertuples():
        ablated = eager(hf, out_proj, tokens, ablate=(row.layer, row.head))[2]
        gap = max(gap, abs(row.delta_loss - (ablated - clean)))
    return gap


def check_repair(model, hf, out_proj, tokens) -> float:
    masks = head_masks(model, "L0H0")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    steps = FinetuneConfig(steps=4, batch_size=2, eval_seqs=2, lr=1e-3)
    config = RepairConfig(
        passes=1,
        census_seq_len=64,
        census_n_seqs=2,
        n_eval_seqs=2,
        train_seq_len=64,
        finetune=steps,
        eval_on_train=True,  # random tokens, held out or not: only the masks are checked here
    )
    corpus = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(1))
    repair(
        model,
        corpus,
        eval_corpus=corpus[:2],
        census_data=corpus[:2],
        heads="L0H0",
        config=config,
        progress=False,
    )
    outside, inside = 0.0, 0.0
    for name, p in model.named_parameters():
        change = (p.detach() - before[name]).abs()
        mask = masks.get(name, torch.zeros_like(change, dtype=torch.bool))
        outside = max(outside, change[~mask].max().item() if (~mask).any() else 0.0)
        inside = max(inside, change[mask].max().item() if mask.any() else 0.0)
    if inside == 0:
        raise AssertionError("repair did not change the targeted head")
    return outside


def check_export(model, hf, out_proj, tokens) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        folder = hs.save_hf(model, Path(tmp) / "export", dtype="float32")
        reloaded = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
        with torch.no_grad():
            theirs = reloaded(tokens).logits
        ours = model(tokens, return_type="logits")
    return float((ours.detach().float() - theirs.float()).abs().max())


CHECKS = {
    "census": check_census,
    "blindness": check_blindness,
    "importance": check_importance,
    "repair": check_repair,
    "export": check_export,
}


def cell(task: str, check: Callable[..., float], *args: object) -> tuple[str, float | None]:
    """The table's text for ``check(*args)``, and its number."""
    try:
        error = check(*args)
    except HeadsurgeonError as e:
        return f"refused: {str(e).splitlines()[0]}", None
    except Exception as e:  # a bug: shown as such, never as a number
        return f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", None
    verdict = "exact" if error <= TOLERANCE[task] else "MISMATCH"
    return f"{verdict} (max error {error:.1g})", error


def footnoted(table: pd.DataFrame, columns: list[str]) -> tuple[pd.DataFrame, list[str]]:
    """``table`` with each long cell of ``columns`` (a refusal or failure line) replaced by its
    kind and a footnote number, and the footnotes, each line once."""
    lines: dict[str, int] = {}

    def short(text: str) -> str:
        if text.startswith("exact") or text.startswith("MISMATCH"):
            return text
        kind, _, line = text.partition(": ")
        number = lines.setdefault(line, len(lines) + 1)
        return f"{kind} [{number}]"

    table = table.assign(**{c: table[c].map(short) for c in columns})
    return table, [f"[{n}] {line}  " for line, n in lines.items()]


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "that every model family headsurgeon loads either gives the numbers of `transformers`' "
        "eager attention on the same weights, within the stated tolerances, or is refused in one "
        "line, on tiny random checkpoints (2 layers, 4 heads) under one TransformerLens major."
    ),
    (
        "trained weights, real checkpoint sizes, speed, or long sequences; a family passing here "
        "is exact on these shapes, not benchmarked."
    ),
)


def main() -> None:
    p = parser(__doc__, f"families/tl{MAJOR}")
    p.add_argument("--families", nargs="+", help="a subset of the families, by name")
    args = p.parse_args()
    started = start(args)
    configs = _configs()
    rows = []
    for family in args.families or configs:
        config, out_proj = configs[family]
        row = {"family": family, "major": f"{MAJOR}.x"}
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / ("tiny-" + "".join(c for c in family.lower() if c.isalnum()))
            hf = build(config, folder)
            generator = torch.Generator().manual_seed(0)
            census_tokens = torch.randint(0, VOCAB, CENSUS_SHAPE, generator=generator)
            long_tokens = torch.randint(0, VOCAB, (1, BLINDNESS_LEN), generator=generator)
            try:
                model = hs.load_model(folder)
            except HeadsurgeonError as e:
                line = str(e).splitlines()[0].replace(f"{tmp}/", "")  # the temporary folder
                refusal = f"refused at loading: {line}"
                rows.append(row | dict.fromkeys(CHECKS, refusal))
                continue
            for task, check in CHECKS.items():
                tokens = long_tokens if task == "blindness" else census_tokens
                row[task], row[f"{task}_error"] = cell(task, check, model, hf, out_proj, tokens)
        rows.append(row)
    table = pd.DataFrame(rows)
    shown, notes = footnoted(table[["family", "major", *CHECKS]], list(CHECKS))
    summary = [
        f"# Every family on TransformerLens {MAJOR}.x: exact or refused",
        "",
        "Tiny random checkpoints (2 layers, 4 heads, 64 wide, float32), loaded from folders with "
        "`load_model`; brute force: `transformers` eager attention of the same weights. "
        f"Tolerances: {', '.join(f'{k} {v:g}' for k, v in TOLERANCE.items())}.",
        "",
        markdown(shown),
        "",
        *notes,
    ]
    write_topic(args.out, {}, {"families.csv": table}, summary, started, scope=SCOPE)


if __name__ == "__main__":
    main()
