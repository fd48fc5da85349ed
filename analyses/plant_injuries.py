"""Plant known injuries into a trained organism and ship the result with its ground truth.

The repair procedure run in reverse: each planted head's slices alone are fine-tuned with
``headsurgeon.finetune.bos_mass_objective`` (squared log-odds error to a target BOS mass, plus the
next-token loss so the head's value and output learn to write little, as natural sinks do), so
every other weight stays bit-identical; one head is silenced by zeroing its value and output
slices. The injured model is written with ``headsurgeon.save_hf`` in float16, next to
``truth.json``: the label every head must get (planted heads as planted, all others healthy).

The injured organism's position-0 convention is a BOS token. Without one, position 0 holds
whatever text token a window starts with, and in our small organism its residual stream is not
linearly separable from the other positions' (a whitened discriminant leaves the two
distributions overlapping at every layer), so one head's query and key cannot single it out:
squared-error planting stalled at BOS mass ~0.65 after 400 steps. With a fixed token at position
0 (the setting of the attention-sink literature) the same objective reaches 0.75 or 0.99 within
~50 steps.

    python analyses/plant_injuries.py                       # organism -> organism-injured
    python analyses/plant_injuries.py --source DIR --out DIR --steps 150
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import torch

from headsurgeon import load_model, save_hf
from headsurgeon.allocator import keep_freed_memory
from headsurgeon.census import CENSUS_CUT, run_census
from headsurgeon.classify import classify_heads
from headsurgeon.data import bundled_text, to_sequences
from headsurgeon.finetune import FinetuneConfig, bos_mass_objective, finetune
from headsurgeon.outputs import atomic_write_text
from headsurgeon.surgery import HeadSet

ORGANISMS = Path(__file__).resolve().parents[1] / "headsurgeon" / "organisms"


@dataclasses.dataclass(frozen=True)
class Injury:
    head: str  # "L{layer}H{head}"
    kind: str  # "sink": attention pushed to position 0; "silenced": value and output zeroed
    target_bos_mass: float | None = None

    @property
    def label(self) -> str:
        """The label the classifier must give (paper thresholds: dead above 0.95)."""
        if self.kind == "silenced" or (self.target_bos_mass or 0) > 0.95:
            return "dead"
        return "BOS-sink"


# Across layers and slopes: shallow heads (H9-H15, slopes 0.044-0.0039) as in BLOOM's sick heads,
# plus one steeper head (H7, slope 0.0625) that has to beat a larger ALiBi penalty.
INJURIES = (
    Injury("L1H12", "sink", 0.75),
    Injury("L1H7", "sink", 0.75),
    Injury("L2H14", "sink", 0.99),
    Injury("L2H10", "sink", 0.75),
    Injury("L3H15", "sink", 0.99),
    Injury("L3H4", "silenced"),
)

# Read by `python -m headsurgeon repair` when --steps/--lr are not given: the paper's lr 5e-5 is
# for billion-parameter BLOOMs and barely moves a freshly zeroed W_O slice of this small model;
# 2e-3 closed more of the held-out gap than 1e-3 in 300 steps (Python docs +1.7% vs +2.0% of the
# uninjured organism) and as much as 500 steps at 1e-3.
RECOMMENDED_REPAIR = {"steps": 300, "lr": 2e-3}


def plant(
    model, injuries, *, steps: int, lr: float, seq_len: int, seed: int, lm_weight: float
) -> None:
    texts = [bundled_text("shakespeare", "train"), bundled_text("python-docs", "train")]
    train = to_sequences(model, texts, seq_len=seq_len, n_seqs=512).tokens
    for target in sorted({i.target_bos_mass for i in injuries if i.kind == "sink"}):
        heads = HeadSet.parse(",".join(i.head for i in injuries if i.target_bos_mass == target))
        logging.info("planting sinks at %s with target BOS mass %.2f", heads, target)
        finetune(
            model,
            heads,
            train,
            config=FinetuneConfig(steps=steps, lr=lr, batch_size=8, seed=seed),
            objective=bos_mass_objective(heads, target, lm_weight=lm_weight),
        )
    with torch.no_grad():
        for injury in injuries:
            if injury.kind == "silenced":
                ((layer, head),) = HeadSet.parse(injury.head)
                attn = model.blocks[layer].attn
                for tensor in (attn.W_V, attn.b_V, attn.W_O):
                    tensor[head] = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="organism", help="organism name or checkpoint folder")
    parser.add_argument("--out", type=Path, default=ORGANISMS / "organism-injured")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--lm-weight",
        type=float,
        default=1.0,
        help="weight of the next-token loss while planting (benign sinks, as natural ones are)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prepend-bos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="position-0 convention of the injured organism (default: a BOS token; see above)",
    )
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.manual_seed(args.seed)
    keep_freed_memory()

    model = load_model(args.source)
    model.cfg.default_prepend_bos = args.prepend_bos
    plant(
        model,
        INJURIES,
        steps=args.steps,
        lr=args.lr,
        seq_len=args.seq_len,
        seed=args.seed,
        lm_weight=args.lm_weight,
    )
    census_seqs = to_sequences(model, seq_len=args.seq_len, n_seqs=CENSUS_CUT.n_seqs)
    labels = classify_heads(run_census(model, census_seqs, progress=False))
    planted = {i.head: i.label for i in INJURIES}
    names = [
        f"L{layer}H{head}" for layer, head in zip(labels["layer"], labels["head"], strict=True)
    ]
    truth = {name: planted.get(name, "healthy") for name in names}
    for name, row in zip(names, labels.itertuples(), strict=True):
        if name in planted:
            logging.info("%s bos_mass=%.3f label=%s", name, row.bos_mass, row.label)
    wrong = [
        f"{name}: {got} (truth {truth[name]})"
        for name, got in zip(names, labels.label, strict=True)
        if got != truth[name]
    ]
    if wrong:
        raise SystemExit(f"planting missed its targets: {'; '.join(wrong)}")

    info = model.headsurgeon_info  # set by load_model; save_hf writes its metadata
    info.metadata = dict(info.metadata)
    info.metadata.update(
        name="organism-injured",
        description=(
            f"{info.metadata.get('name', args.source)} with planted injuries: "
            + ", ".join(f"{i.head} {i.kind} -> {i.label}" for i in INJURIES)
        ),
        injuries=[dataclasses.asdict(i) | {"label": i.label} for i in INJURIES],
        repair=RECOMMENDED_REPAIR,
    )
    out = save_hf(model.to(torch.float16), args.out, overwrite=args.overwrite)
    atomic_write_text(
        out / "truth.json",
        json.dumps(
            {
                "source": str(args.source),
                "injuries": info.metadata["injuries"],
                "labels": truth,
                "plant_settings": {k: str(v) for k, v in vars(args).items()},
            },
            indent=2,
        ),
    )
    logging.info("wrote %s", out)


if __name__ == "__main__":
    main()
