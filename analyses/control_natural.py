"""The repair's control arm on sinks that grew by themselves: re-initialise, retrain, or prune?

``figures/sinks/control/`` found that organism-injured's five planted sinks get gradients under
the control arm (the same heads retrained from their own weights) and stay sinks, while the
repair (re-initialise Q/K/V, zero W_O, retrain) makes them healthy. Planted sinks were put
there by hand; this asks the same of heads that became sinks during training: the BOS-sink
L0H7 of the natural-collapse arm without positional bias (weight decay 0.1), and the most
sink-like heads of its ALiBi twin, L3H6 and L3H7 (which the classifier labels healthy at its
thresholds); and, for comparison, a healthy head of L0H7's layer, L0H6. Per experiment
(``headsurgeon.repair``, one pass, explicit ``--heads``, with its control arm), at equal steps,
data, seed and schedule: the model as given, pruned (mean- and zero-ablated), repaired and
control, with

- training and held-out perplexity (the repair report's), and the held-out NLL per sequence of
  every arm on the same windows, for paired comparisons (mean difference, its standard error,
  a sign test);
- the target head's BOS mass, sink score, label (census on 64 x 256-token held-out windows),
  Gu et al.'s sink score (100 x 64 tokens) and its mean-ablation cost after each arm;
- the gradient of the training loss on the head's slices in the model as given (one batch of
  8 training windows), beside the median over the other heads, and how far the control arm
  moved each slice.

    python analyses/control_natural.py  # about 25 CPU-minutes at 300 steps per arm

Each experiment's raw results are kept in ``--runs`` (default ``runs/control_natural``) and
reused by a later call, so an interrupted run continues with the next experiment. Writes
``figures/sinks/control_natural/``: ``perplexity.csv``, ``heads.csv``,
``nll_per_sequence.csv``, ``paired.csv`` / ``.png``, ``gradients.csv``, ``training.csv`` (each
trained arm's evaluations), ``reports/<experiment>.json`` (the repair reports), ``logs/`` (any
``*.log`` in ``--runs``) and ``summary.md``.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
import torch.nn.functional as F
from _common import ROOT, gu_census, markdown, parser, start, style, write_topic
from control_arm import ARMS, ppl_table, verdict

from headsurgeon import load_model
from headsurgeon.census import run_census
from headsurgeon.classify import classify_heads
from headsurgeon.data import CORPORA, as_sequences, bundled_text
from headsurgeon.finetune import FinetuneConfig
from headsurgeon.heads import HeadSet
from headsurgeon.importance import ablate_heads
from headsurgeon.loading import model_info
from headsurgeon.repair import repair
from headsurgeon.stats import mcnemar_p
from headsurgeon.surgery import head_slices, head_tensors, load_head_slices

MODELS = ROOT / "analyses" / "natural_collapse_models"
# experiment -> (model folder, target head)
EXPERIMENTS = {
    "no bias, wd 0.1: L0H7": ("nobias-wd0.1-s0", "L0H7"),
    "ALiBi, wd 0.1: L3H6": ("alibi-wd0.1-s0", "L3H6"),
    "ALiBi, wd 0.1: L3H7": ("alibi-wd0.1-s0", "L3H7"),
    # A healthy comparison: the fine-tuning text (plain bundled corpora) is not these models'
    # training mix (38% of every window synthetic spans), so retraining any head may lower
    # plain-text perplexity. L0H6: the healthy head of L0H7's layer with the nearest output share.
    "no bias, wd 0.1: L0H6 (healthy comparison)": ("nobias-wd0.1-s0", "L0H6"),
}
SEQ_LEN = 256  # the natural-collapse models' training windows; their summary's census length
CENSUS_SEQS = 64


def slug(experiment: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in experiment.lower()).strip("-")


@torch.no_grad()
def seq_nll(model: Any, tokens: torch.Tensor, batch_size: int = 16) -> np.ndarray:
    """Each row's mean next-token NLL over positions 1.. (what the report's perplexity averages)."""
    out = []
    for batch in tokens.split(batch_size):
        logits = model(batch).float()
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch[:, 1:], reduction="none")
        out.append(nll.mean(-1))
    return torch.cat(out).double().numpy()


def gradient_norms(model: Any, tokens: torch.Tensor) -> pd.DataFrame:
    """The norm of the training loss's gradient on every head's slice of every tensor."""
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        model(tokens, return_type="loss").backward()
    rows = []
    for layer in range(model.cfg.n_layers):
        for name, tensor in head_tensors(model, layer).items():
            norms = tensor.heads(tensor.param.grad).flatten(1).norm(dim=1)
            rows += [
                {"layer": layer, "head": h, "tensor": name, "grad_norm": float(v)}
                for h, v in enumerate(norms)
            ]
    model.zero_grad(set_to_none=True)
    return pd.DataFrame(rows)


def head_row(model: Any, head: str, census_seqs: Any) -> dict[str, Any]:
    """The target's census metrics and label, and Gu et al.'s sink score, in ``model``."""
    census = classify_heads(run_census(model, census_seqs, progress=False))
    gu = gu_census(model)
    ((layer, index),) = HeadSet.parse(head).by_layer().items()
    at = (census["layer"] == layer) & (census["head"] == index[0])
    row = census[at].iloc[0]
    return {
        "bos_mass": float(row["bos_mass"]),
        "sink_score": float(row["sink_score"]),
        "output_share": float(row["output_share"]),
        "label": row["label"],
        "gu_sink_score": float(gu[at.to_numpy()]["sink_score"].iloc[0]),
        "heads_sick": int((census["label"] != "healthy").sum()),
    }


def run_experiment(experiment: str, args: Any) -> dict[str, Any]:
    """One experiment's raw results (kept in ``args.runs``; reused when already there)."""
    folder = args.runs / slug(experiment)
    if (folder / "result.json").is_file():
        return json.loads((folder / "result.json").read_text())
    started = time.process_time()
    name, head = EXPERIMENTS[experiment]
    model = load_model(str(MODELS / name))
    info = model_info(model)
    heldout = as_sequences(info, None, seq_len=SEQ_LEN, n_seqs=args.eval_seqs)
    census_seqs = as_sequences(info, None, seq_len=SEQ_LEN, n_seqs=CENSUS_SEQS)
    train = as_sequences(info, [bundled_text(c, "train") for c in CORPORA], seq_len=SEQ_LEN)
    grad_batch = train.tokens[torch.linspace(0, train.n_seqs - 1, 8).round().long()]
    grads = gradient_norms(model, grad_batch)
    given = head_slices(model, head)
    nll, heads = {}, {}

    def measure(arm: str) -> None:
        nll[arm] = seq_nll(model, heldout.tokens)
        heads[arm] = head_row(model, head, census_seqs)
        with ablate_heads(model, head, "mean", census_seqs, progress=False):
            ablated = seq_nll(model, heldout.tokens)
        cost = ablated - nll[arm]  # the head's mean-ablation cost in this arm, per sequence
        heads[arm]["dloss_mean"] = float(cost.mean())
        heads[arm]["dloss_mean_se"] = float(cost.std(ddof=1) / math.sqrt(len(cost)))
        if arm == "given":
            nll["pruned_mean"] = ablated
            with ablate_heads(model, head, "zero", progress=False):
                nll["pruned_zero"] = seq_nll(model, heldout.tokens)

    measure("given")
    config = FinetuneConfig(steps=args.steps, lr=args.lr, eval_every=args.eval_every)
    work = folder / "work"
    result = repair(
        model,
        heads=head,
        passes=1,
        finetune_config=config,
        census_seq_len=SEQ_LEN,
        census_n_seqs=CENSUS_SEQS,
        n_eval_seqs=args.eval_seqs,
        # Every arm is reported, whatever the library's verdict would be.
        max_ppl_increase=math.inf,
        max_collateral=model.cfg.n_layers * model.cfg.n_heads,
        work_dir=work,
        progress=False,
    )
    report = result.to_dict()
    moved = {}
    for arm, sub in (("repaired", "pass1"), ("control", "control1")):
        trained = torch.load(work / sub / "heads.pt")
        load_head_slices(model, head, trained)
        measure(arm)
        moved[arm] = {
            k.rsplit(".", 1)[1]: float((trained[k] - given[k]).norm() / given[k].norm())
            for k in given
        }
    load_head_slices(model, head, given)
    folder.mkdir(parents=True, exist_ok=True)
    raw = {
        "experiment": experiment,
        "model": name,
        "head": head,
        "report": json.loads(json.dumps(report, default=str)),
        "heads": heads,
        "nll": {arm: values.tolist() for arm, values in nll.items()},
        "grads": grads.to_dict(orient="list"),
        "moved": moved,
        "train_loss": {
            arm: p.training.history.to_dict(orient="list")
            for arm, p in (("repaired", result.passes[0]), ("control", result.control[0]))
        },
        "cpu_minutes": (time.process_time() - started) / 60,
    }
    (folder / "result.json").write_text(json.dumps(raw))
    return raw


def sign_test(d: np.ndarray) -> float:
    """Two-sided exact sign test of ``d`` (ties dropped): McNemar's test of the windows lower
    against those higher (the same binomial test)."""
    return mcnemar_p(int((d < 0).sum()), int((d > 0).sum()))


ARM_NAMES = {"given": "injured", "repaired": "repaired", "control": "control"}
PAIRS = [
    ("repaired", "control"),
    ("repaired", "given"),
    ("control", "given"),
    ("pruned_mean", "given"),
    ("pruned_zero", "given"),
    ("repaired", "pruned_mean"),
]


def difference(experiment: str, a: str, b: str, nll_a: list, nll_b: list) -> dict[str, Any]:
    """Per-window held-out NLL differences a - b: mean, standard error, sign test."""
    d = np.asarray(nll_a) - np.asarray(nll_b)
    return {
        "experiment": experiment,
        "a": a,
        "b": b,
        "n": len(d),
        "mean_diff": d.mean(),
        "se": d.std(ddof=1) / math.sqrt(len(d)),
        "a_lower": int((d < 0).sum()),
        "sign_p": sign_test(d),
    }


def paired(raw: dict[str, Any]) -> pd.DataFrame:
    """Per-sequence held-out NLL differences a - b on the same windows."""
    e, nll = raw["experiment"], raw["nll"]
    return pd.DataFrame([difference(e, a, b, nll[a], nll[b]) for a, b in PAIRS])


# The sink against the healthy comparison head of the same model, arm by arm (the same windows).
SINK_VS_HEALTHY = ("no bias, wd 0.1: L0H7", "no bias, wd 0.1: L0H6 (healthy comparison)")


def sink_vs_healthy(raws: list[dict[str, Any]]) -> pd.DataFrame:
    """Each trained arm's held-out NLL with the sink trained minus with the healthy head trained."""
    by_name = {r["experiment"]: r["nll"] for r in raws}
    if not set(SINK_VS_HEALTHY) <= set(by_name):
        return pd.DataFrame()
    sink, healthy = (by_name[e] for e in SINK_VS_HEALTHY)
    return pd.DataFrame(
        [
            difference("no bias, wd 0.1: L0H7 vs L0H6", f"{arm} L0H7", f"{arm} L0H6", *pair)
            for arm in ("repaired", "control", "pruned_mean")
            for pair in [(sink[arm], healthy[arm])]
        ]
    )


def gradient_rows(raw: dict[str, Any]) -> pd.DataFrame:
    """The target's gradient norm per tensor beside the other heads' median; the control's move."""
    grads = pd.DataFrame(raw["grads"])
    ((layer, index),) = HeadSet.parse(raw["head"]).by_layer().items()
    target = (grads["layer"] == layer) & (grads["head"] == index[0])
    rows = []
    for tensor, sub in grads.groupby("tensor", sort=False):
        mine = float(sub[target[sub.index]]["grad_norm"].iloc[0])
        others = sub[~target[sub.index]]["grad_norm"]
        rows.append(
            {
                "experiment": raw["experiment"],
                "tensor": tensor,
                "grad_norm": mine,
                "median_other_heads": float(others.median()),
                "rank_of_32": int((sub["grad_norm"] > mine).sum()) + 1,
                "nonzero": mine > 0,
                # b_K cannot move a softmax (it adds q . b_K to every key's score alike): its
                # gradient is rounding noise in every head, so it is no evidence either way.
                "counts": tensor != "b_K",
                "control_rel_change": raw["moved"]["control"][tensor],
            }
        )
    return pd.DataFrame(rows)


# The arms of the paired figure, each against the model as given.
SHOWN = {
    "pruned_mean": ARMS["pruned_mean"],
    "pruned_zero": ARMS["pruned_zero"],
    "repaired": ARMS["repaired"],
    "control": ARMS["control"],
}


def paired_figure(pairs: pd.DataFrame) -> go.Figure:
    """Held-out NLL of each arm minus the model as given, mean over windows +- 1 SE."""
    fig = go.Figure()
    for arm, (label, colour) in SHOWN.items():
        sub = pairs[(pairs["a"] == arm) & (pairs["b"] == "given")]
        fig.add_trace(
            go.Bar(
                name=label,
                x=[e.replace(": ", "<br>", 1) for e in sub["experiment"]],
                y=sub["mean_diff"],
                error_y={"type": "data", "array": sub["se"]},
                marker={"color": colour},
            )
        )
    fig.update_layout(barmode="group")
    fig.update_yaxes(title_text="NLL - as given (nats/token)")
    subtitle = (
        "paired over the same held-out windows; error bars: 1 standard error of the mean "
        "per-window difference"
    )
    style(fig, "Natural sinks: repair versus control versus prune", subtitle, 1100, 600)
    return fig


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "whether re-initialising a head that became a sink (or sink-like) by itself in training "
        "(Q/K/V re-drawn, W_O zeroed) and retraining its slices beats retraining the same slices "
        "from their own weights (the control: same data, steps, seed and schedule) or pruning "
        "it, on the natural-collapse models: no-bias L0H7 (the one BOS-sink), ALiBi L3H6 and "
        "L3H7 (the most sink-like heads, labelled healthy), and a healthy head (no-bias L0H6) "
        "through the same arms, paired on the same held-out windows. Numerics: the models were "
        "trained under the relative bias in bfloat16 autocast; every arm runs and is measured in "
        "float32 without autocast, the trained slices rounded through float16 as the repair "
        "saves them."
    ),
    (
        "other seeds, longer training, larger models, other learning rates or step counts (one "
        "pass, see the protocol), nor whether a difference persists with more steps; the "
        "windows are neighbouring text, so the standard errors and sign tests are optimistic."
    ),
)


def main() -> None:
    p = parser(__doc__, "sinks/control_natural")
    p.add_argument("--experiments", nargs="+", default=list(EXPERIMENTS), choices=EXPERIMENTS)
    p.add_argument("--steps", type=int, default=300, help="fine-tuning steps per arm")
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    # The precedent's (figures/sinks/control): organism-injured's recommended lr.
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--eval-seqs", type=int, default=128, help="held-out windows of 256 tokens")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "control_natural")
    args = p.parse_args()
    started = start(args)
    raws = [run_experiment(e, args) for e in args.experiments]
    ppl = pd.concat(ppl_table(r["report"], r["experiment"]) for r in raws)
    heads = pd.DataFrame(
        [
            {"experiment": r["experiment"], "head": r["head"], "arm": ARMS[ARM_NAMES[a]][0], **m}
            for r in raws
            for a, m in r["heads"].items()
        ]
    )
    nll = pd.concat(
        pd.DataFrame(r["nll"])
        .assign(experiment=r["experiment"])
        .rename_axis("window")
        .reset_index()
        for r in raws
    )
    pairs = pd.concat([*(paired(r) for r in raws), sink_vs_healthy(raws)])
    grads = pd.concat(gradient_rows(r) for r in raws)
    training = pd.concat(
        pd.DataFrame(history).assign(experiment=r["experiment"], arm=arm)
        for r in raws
        for arm, history in r["train_loss"].items()
    )
    settings = raws[0]["report"]["settings"]
    ft = settings["finetune"]
    cpu = sum(r["cpu_minutes"] for r in raws)
    lines = summary_lines(raws, ppl, heads, pairs, grads, settings, ft, cpu)
    reports = {
        f"reports/{slug(r['experiment'])}.json": json.dumps(r["report"], indent=1) for r in raws
    }

    def extra(folder: Path) -> None:
        (folder / "reports").mkdir()
        for log in sorted(args.runs.glob("*.log")):  # the runs' logs, if kept there
            (folder / "logs").mkdir(exist_ok=True)
            shutil.copy2(log, folder / "logs" / log.name)

    tables = {
        "perplexity.csv": ppl,
        "heads.csv": heads,
        "nll_per_sequence.csv": nll,
        "paired.csv": pairs,
        "gradients.csv": grads,
        "training.csv": training,
        **reports,
    }
    # One figure: control_arm's perplexity bars, eight panels here, hide differences this small.
    figures = {"paired": paired_figure(pairs)}
    write_topic(args.out, figures, tables, lines, started, extra, scope=SCOPE)


def answer(raw: dict[str, Any], pairs: pd.DataFrame) -> str:
    """One line: which of repair and control has the lower held-out NLL, if the pairs resolve it
    (|mean difference| > 2 SE and a sign test p < 0.05), and what became of the head."""
    e = raw["experiment"]
    rc = pairs[(pairs["experiment"] == e) & (pairs["a"] == "repaired") & (pairs["b"] == "control")]
    d, se, p = (float(rc[c].iloc[0]) for c in ("mean_diff", "se", "sign_p"))
    if abs(d) > 2 * se and p < 0.05:
        said = (
            "re-initialisation beats retraining" if d < 0 else "retraining beats re-initialisation"
        )
    else:
        said = "no difference resolved between re-initialisation and retraining"
    h = raw["heads"]
    return (
        f"{e}: {said} (held-out NLL repaired - control {d:+.4f} nats, SE {se:.4f}, sign test "
        f"p = {p:.2g}); BOS mass {h['given']['bos_mass']:.3f} as given "
        f"({h['given']['label']}), {h['repaired']['bos_mass']:.3f} repaired "
        f"({h['repaired']['label']}), {h['control']['bos_mass']:.3f} control "
        f"({h['control']['label']})."
    )


def reading(raws: list[dict[str, Any]], pairs: pd.DataFrame) -> list[str]:
    """What the numbers say across experiments, each sentence computed from them."""
    by_name = {r["experiment"]: r for r in raws}
    diff = pairs.set_index(["experiment", "a", "b"])
    lines = ["## Reading", ""]
    sink = by_name.get(SINK_VS_HEALTHY[0])
    if sink is not None:
        h, moved = sink["heads"], sink["moved"]["control"]
        lines.append(
            "- The natural sink gets gradients and is trained by the control, as the planted "
            "ones were (`figures/sinks/control/`): the control moved L0H7's W_V by "
            f"{moved['W_V']:.2f} and W_O by {moved['W_O']:.2f} of their norms. It stays a "
            f"{h['control']['label']} by the label (BOS mass {h['given']['bos_mass']:.3f} -> "
            f"{h['control']['bos_mass']:.3f}), while its mean-ablation cost on these windows "
            f"rises from {h['given']['dloss_mean']:+.4f} (SE {h['given']['dloss_mean_se']:.4f}; "
            "`figures/natural_collapse/` calls it dormant on its census windows, +0.0026, SE "
            f"0.0015) to {h['control']['dloss_mean']:+.4f} (repaired: "
            f"{h['repaired']['dloss_mean']:+.4f}, as a {h['repaired']['label']} head): "
            "retrained either way, the head comes to matter about equally."
        )
    if set(SINK_VS_HEALTHY) <= set(by_name):
        versus = "no bias, wd 0.1: L0H7 vs L0H6"
        arms = [
            f"{arm} {diff.loc[(versus, f'{arm} L0H7', f'{arm} L0H6'), 'mean_diff']:+.4f} "
            f"(SE {diff.loc[(versus, f'{arm} L0H7', f'{arm} L0H6'), 'se']:.4f})"
            for arm in ("repaired", "control")
        ]
        drop = diff.loc[(SINK_VS_HEALTHY[1], "control", "given"), "mean_diff"]
        lines.append(
            "- The perplexity drop is not the sink's: the healthy L0H6 put through the same "
            f"arms lowers held-out NLL as much (control - as given {drop:+.4f} nats; L0H7 "
            f"minus L0H6: {', '.join(arms)}). Retraining a healthy head of the same layer on the "
            "plain corpora gives it too, most likely by adapting to text without the training "
            "mix's synthetic spans (not tested here)."
        )
    worse = [
        e
        for e in by_name
        if all(
            diff.loc[(e, "pruned_mean", "given"), "mean_diff"]
            > diff.loc[(e, arm, "given"), "mean_diff"]
            for arm in ("repaired", "control")
        )
    ]
    lines.append(
        f"- Mean-ablation pruning has a higher held-out NLL than both trained arms in "
        f"{len(worse)} of {len(by_name)} experiments (point estimates; paired.csv)."
    )

    def span(arm: str) -> str:
        masses = [r["heads"][arm]["bos_mass"] for e, r in by_name.items() if "healthy" not in e]
        return f"{min(masses):.3f}-{max(masses):.3f}"

    said = {e: answer(r, pairs).split(": ", 2)[-1].split(" (")[0] for e, r in by_name.items()}
    beats = [e for e, a in said.items() if a.startswith("re-initialisation beats")]
    loses = [e for e, a in said.items() if a.startswith("retraining beats")]
    lines.append(
        f"- Re-initialisation beats retraining (resolved) in {len(beats)} of {len(said)} "
        f"experiments{': ' + '; '.join(beats) if beats else ''}; retraining beats "
        f"re-initialisation in {len(loses)}{': ' + '; '.join(loses) if loses else ''}; the "
        "rest are unresolved. Re-initialisation does change the sink-like heads' pattern: "
        f"BOS mass after the repair {span('repaired')}, after the control {span('control')}, "
        f"as given {span('given')}."
    )
    return [*lines, ""]


def reproduced(raws: list[dict[str, Any]], ppl: pd.DataFrame) -> float:
    """The largest relative gap between exp(mean per-window NLL) and the report's perplexity."""
    gaps = []
    for r in raws:
        reported = ppl[ppl["experiment"] == r["experiment"]].set_index("arm")["heldout_ppl"]
        for arm, values in r["nll"].items():
            label = ARMS[ARM_NAMES.get(arm, arm)][0]
            gaps.append(abs(math.exp(np.mean(values)) / reported[label] - 1))
    return max(gaps)


def summary_lines(
    raws: list[dict[str, Any]],
    ppl: pd.DataFrame,
    heads: pd.DataFrame,
    pairs: pd.DataFrame,
    grads: pd.DataFrame,
    settings: dict[str, Any],
    ft: dict[str, Any],
    cpu: float,
) -> list[str]:
    """summary.md: what it tests, the answer per experiment, every table."""
    n_eval = settings["eval_sequences"][0]
    given_labels = "; ".join(
        f"{r['experiment']}: {r['heads']['given']['label']} (BOS mass "
        f"{r['heads']['given']['bos_mass']:.3f}, Gu sink score "
        f"{r['heads']['given']['gu_sink_score']:.3f})"
        for r in raws
    )
    lines = [
        "# The control arm on natural sinks: re-initialisation versus retraining versus pruning",
        "",
        "## Protocol",
        "",
        "One seed (0), one model per arm, one pass of "
        f"{ft['steps']} steps at peak lr {ft['lr']:g} (batch {ft['batch_size']} x "
        f"{settings['train_sequences'][1]} tokens of the bundled training corpora; "
        f"{cpu:.1f} CPU-minutes for all experiments; the steps were chosen from a timed step "
        "so that every arm fits a budget of 30 CPU-minutes), organism scale "
        "(4 layers x 8 heads, 128 wide, 1.3M parameters), models from a 4,000-step training "
        "(`figures/natural_collapse/`). Held-out perplexity and the paired tests use the "
        f"same {n_eval} held-out windows of {settings['eval_sequences'][1]} tokens; the "
        "mean-ablation means come from the census windows (64 x 256 held-out tokens, which "
        "overlap them). Windows are neighbouring text from two corpora, not independent "
        "draws: the standard errors and sign tests treat them as independent and are "
        "optimistic to that extent. Labels are the classifier's at its default thresholds on "
        f"that census; the targets as given: {given_labels}. ALiBi L3H6 and L3H7 are the most "
        "sink-like heads of their model, not sinks by the classifier (it labels no ALiBi head "
        "a sink at these thresholds): for them the question is about sink-like heads. The "
        "fine-tuning text (the plain bundled corpora) is not what these models were trained "
        "on (38% of every training window was a synthetic span), so retraining any head may "
        "lower plain-text perplexity by adapting to it: the healthy head L0H6 of the no-bias "
        "model, put through the same arms, measures how much of a drop is that. It "
        "does not test other seeds, longer training, larger models, other learning rates or "
        "step counts, nor whether any difference persists with more steps.",
        "",
        "## Answer: does re-initialisation beat retraining on a sink that grew by itself?",
        "",
        *(f"- {answer(raw, pairs)}" for raw in raws),
        "",
        "A resolved difference: |mean| > 2 SE and a sign test p < 0.05. The per-window NLLs "
        "reproduce the reports' held-out perplexities (largest relative gap "
        f"{reproduced(raws, ppl):.1e}).",
        "",
    ]
    for raw in raws:
        e = raw["experiment"]
        sub = ppl[ppl["experiment"] == e]
        h = heads[heads["experiment"] == e].set_index("arm")
        pr = pairs[pairs["experiment"] == e].set_index(["a", "b"])
        g = grads[grads["experiment"] == e]
        lines += [f"## {e}", ""]
        for split, name in (("train", "Training"), ("heldout", "Held-out")):
            given, fixed, control, said = verdict(sub, split)
            lines.append(
                f"- {name} perplexity: as given {given:.3f}, repaired {fixed:.3f}, control "
                f"{control:.3f}: {said}."
            )
        rc = pr.loc[("repaired", "control")]
        lines.append(
            f"- Paired held-out NLL, repaired - control, {int(rc['n'])} windows: "
            f"{rc['mean_diff']:+.4f} nats (SE {rc['se']:.4f}); repaired lower on "
            f"{int(rc['a_lower'])}/{int(rc['n'])}, sign test p = {rc['sign_p']:.2g}."
        )
        for a in ("repaired", "control", "pruned_mean", "pruned_zero"):
            r = pr.loc[(a, "given")]
            lines.append(
                f"  - {a} - as given: {r['mean_diff']:+.4f} (SE {r['se']:.4f}), lower on "
                f"{int(r['a_lower'])}/{int(r['n'])}, p = {r['sign_p']:.2g}."
            )
        states = "; ".join(
            f"{arm}: BOS mass {row['bos_mass']:.3f}, Gu sink score {row['gu_sink_score']:.3f}, "
            f"{row['label']}, mean-ablation cost {row['dloss_mean']:+.4f} "
            f"(SE {row['dloss_mean_se']:.4f})"
            for arm, row in h.iterrows()
        )
        lines.append(f"- The head after each arm: {states}.")
        counted = g[g["counts"]]
        nonzero = (
            "nonzero on W_Q, W_K, W_V, W_O and b_Q, b_V"
            if counted["nonzero"].all()
            else "ZERO on " + ", ".join(counted[~counted["nonzero"]]["tensor"])
        )
        lines.append(
            "- Gradient in the model as given (one batch of 8 training windows): "
            f"{nonzero}; norm / median of the other 31 heads: "
            + ", ".join(
                f"{r.tensor} {r.grad_norm:.2e}/{r.median_other_heads:.2e}" for r in g.itertuples()
            )
            + " (b_K's gradient is rounding noise in every head: a key bias cannot move a "
            "softmax). The control moved its slices by (relative norm) "
            + ", ".join(f"{r.tensor} {r.control_rel_change:.3f}" for r in g.itertuples())
            + "."
        )
        lines.append("")
    lines += reading(raws, pairs)
    versus = pairs[pairs["experiment"] == "no bias, wd 0.1: L0H7 vs L0H6"]
    if len(versus):
        lines += [
            "## The sink against a healthy head of its layer (no bias, wd 0.1)",
            "",
            "Held-out NLL with L0H7 put through an arm minus with L0H6 put through the same "
            "arm (same model, same windows): negative means acting on the sink lowers NLL more "
            "than acting on the healthy head.",
            "",
            *(
                f"- {r.a} - {r.b}: {r.mean_diff:+.4f} nats (SE {r.se:.4f}), lower on "
                f"{r.a_lower}/{r.n}, sign test p = {r.sign_p:.2g}."
                for r in versus.itertuples()
            ),
            "",
        ]
    lines += [
        "## Every arm",
        "",
        markdown(ppl, 4),
        "",
        markdown(heads, 3),
        "",
        "## Paired held-out NLL differences (a - b, nats per token, per window; paired.png)",
        "",
        markdown(pairs, 3),
        "",
        "## Gradients on the target's slices (model as given)",
        "",
        markdown(grads, 3),
        "",
        "Command: `python analyses/control_natural.py` (defaults: "
        f"`--steps {ft['steps']} --eval-every {ft['eval_every']} --lr {ft['lr']:g} "
        f"--eval-seqs {n_eval}`); one torch thread; CPU minutes per experiment: "
        + ", ".join(f"{r['experiment']} {r['cpu_minutes']:.1f}" for r in raws)
        + " (each computed once; a later call reuses it from `--runs`, so the run time below is "
        "that call's alone).",
    ]
    return lines


if __name__ == "__main__":
    main()
