"""The committed evidence reads as its data say: every summary of ``analyses/`` opens with what
it tests and what it does not, and each number the docs quote from a committed table is that
table's number (recomputed here from the CSV or JSON, formatted as quoted)."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "figures"
sys.path.insert(0, str(ROOT / "analyses"))
from _common import scoped_summaries, with_scope  # noqa: E402

SCOPED = scoped_summaries()


def test_every_analysis_script_that_writes_a_summary_has_a_scope() -> None:
    writers = {
        p.name
        for p in (ROOT / "analyses").glob("*.py")
        if p.name != "_common.py" and "write_topic(" in p.read_text()
    }
    assert writers <= {script.name for script, _, _ in SCOPED}


@pytest.mark.parametrize("script, summary, scope", SCOPED, ids=lambda x: getattr(x, "name", ""))
def test_each_committed_summary_opens_with_its_scripts_scope(
    script: Path, summary: Path, scope: tuple[str, str]
) -> None:
    text = summary.read_text()
    assert with_scope(text, scope) == text, (
        f"{summary.relative_to(ROOT)} does not open with {script.name}'s SCOPE: run "
        "`python analyses/_common.py` (or the script)"
    )


# --- quoted numbers -----------------------------------------------------------------------------


def _flat(path: str) -> str:
    """A doc's text with every run of whitespace one space (quotes break across lines)."""
    return re.sub(r"\s+", " ", (ROOT / path).read_text())


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def sink_cache_claims() -> Iterator[tuple[str, str]]:
    cache = pd.read_csv(FIGURES / "sinks/table/sink_cache.csv")
    injured = cache[cache["model"] == "organism-injured"].set_index(["sinks", "window"])
    (d0, se0), (d4, se4) = (injured.loc[k, ["dnll", "dnll_se"]] for k in [(0, 64), (4, 64)])
    yield (
        "docs/long-contexts.md",
        f"0 + 64 costs {d0:+.3f} nats (standard error {se0:.3f}) and 4 + 64 {d4:+.3f} ({se4:.3f})",
    )
    run = json.loads((FIGURES / "sinks/sink_cache_injured.json").read_text())
    assert "--seq-len 2048" in run["command"] and "--head-seq-len 2048" in run["command"]
    heads = pd.DataFrame(run["by_head"]).sort_values("rank")
    heads["name"] = "L" + heads["layer"].astype(str) + "H" + heads["head"].astype(str)
    by = heads.set_index("name")
    planted = ["L2H14", "L3H15", "L1H7", "L2H10"]
    assert list(heads["name"][:4]) == planted
    listed = ", ".join(
        f"{n} {by.loc[n, 'dnll']:+.3f} ({by.loc[n, 'dnll_se']:.3f})" for n in planted
    )
    yield "docs/long-contexts.md", f"the four that need them most are planted: {listed} nats"
    l1h12 = by.loc["L1H12"]
    assert abs(l1h12["dnll"]) < 2 * l1h12["dnll_se"]  # "not resolved from zero"
    yield (
        "docs/long-contexts.md",
        f"the planted L1H12 ranks {_ordinal(int(l1h12['rank']))} of {len(heads)} at "
        f"{l1h12['dnll']:+.3f} ({l1h12['dnll_se']:.3f}), not resolved from zero",
    )
    assert by.loc["L3H4", "dnll"] == 0


def natural_collapse_claims() -> Iterator[tuple[str, str]]:
    traj = pd.read_csv(FIGURES / "natural_collapse/trajectories.csv")
    top = {arm: g.groupby("step")["bos_mass"].max() for arm, g in traj.groupby("arm")}
    wd01, wd05 = top["ALiBi, wd 0.1 (seed 0)"], top["ALiBi, wd 0.5 (seed 0)"]
    rates = [(t.max() - t[1000]) / (t.idxmax() - 1000) * 1000 for t in (wd01, wd05)]
    yield (
        "docs/organisms.md",
        f"grew by {rates[0]:.3f} (wd 0.1) and {rates[1]:.3f} (wd 0.5) per 1,000 steps",
    )
    yield (
        "docs/organisms.md",
        f"moved {wd01[4000] - wd01[3000]:+.3f} (wd 0.1, past its peak of {wd01.max():.3f} at "
        f"step {wd01.idxmax():,}) and {wd05[4000] - wd05[3000]:+.3f} (wd 0.5; "
        f"{wd05[4000] - wd05[3500]:+.3f} over the last 500)",
    )
    heads = pd.read_csv(FIGURES / "natural_collapse/heads.csv")
    for arm, doc_arm in [("no bias, wd 0.1 (seed 0)", "no bias, wd 0.1")]:
        row = heads[heads["arm"] == arm].sort_values("bos_mass").iloc[-1]
        yield (
            "docs/organisms.md",
            f"| {doc_arm} | {row['bos_mass']:.3f} (L{row['layer']}H{row['head']}, BOS-sink)",
        )


def retrieval_documents_claims() -> Iterator[tuple[str, str]]:
    def documents(name: str) -> int:
        meta = json.loads(
            (ROOT / "analyses/mitigation_models" / name / "headsurgeon.json").read_text()
        )
        training = meta["training"]
        per_step = round(training["config"]["batch"] * training["config"]["retrieval_share"])
        return training["steps"] * per_step

    yield (
        "docs/alibi-variants.md",
        f"8x the passkey/needle training documents ({documents('standard'):,} against "
        f"{documents('L512-standard'):,})",
    )
    assert documents("standard") == 8 * documents("L512-standard")


def training_numerics_claims() -> Iterator[tuple[str, str]]:
    m = pd.read_csv(FIGURES / "training_numerics/matrix.csv")

    def row(arm: str, reference: str, dtype: str, region: str) -> pd.Series:
        hit = m[
            (m["arm"] == arm)
            & (m["reference"] == reference)
            & (m["bias"] == "absolute")
            & (m["dtype"] == dtype)
            & (m["region"] == region)
        ]
        assert len(hit) == 1
        return hit.iloc[0]

    def interval(r: pd.Series) -> str:
        half = 1.96 * r["dnll_se"]
        return f"{r['mean_dnll']:+.3f} [{r['mean_dnll'] - half:+.3f}, {r['mean_dnll'] + half:+.3f}]"

    for arm in ("absolute-bfloat16", "organism"):
        inside, far = (row(arm, "training", "float32", r) for r in ("inside L", "4L-8L"))
        yield "docs/tools/blindness.md", f"| {interval(inside).lstrip('+')} |"
        yield "docs/tools/blindness.md", f"| {interval(far).lstrip('+')} |"
    for arm in ("relative-bfloat16", "absolute-float32"):
        inside, far = (row(arm, "training", "bfloat16", r) for r in ("inside L", "4L-8L"))
        yield "docs/tools/blindness.md", f"{interval(inside)} inside L and {far['mean_dnll']:+.3f}"
    own = row("absolute-bfloat16", "float64", "bfloat16", "inside L")
    far = row("absolute-bfloat16", "float64", "bfloat16", "4L-8L")
    yield "docs/tools/blindness.md", f"cost {own['mean_dnll']:+.3f} nats inside the training length"
    yield "docs/tools/blindness.md", f"and {far['mean_dnll']:+.2f} at 4-8 times it against float64"


def _mcnemar(b: int, c: int) -> float:
    """Exact two-sided McNemar p, written out here rather than imported (a second derivation)."""
    n = b + c
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n) if n else 1.0


def retrieval_claims() -> Iterator[tuple[str, str]]:
    folder = FIGURES / "retrieval_distance"
    trials = {m: pd.read_csv(folder / f"trials_{m}_passkey.csv") for m in ("standard", "log")}

    def against_baseline(model: str, lo: int) -> str:
        t = trials[model][trials[model]["distance_lo"] == lo]
        b = int((t["top1_correct"] & ~t["baseline_top1_correct"]).sum())
        c = int((~t["top1_correct"] & t["baseline_top1_correct"]).sum())
        acc, base = t["top1_correct"].mean(), t["baseline_top1_correct"].mean()
        return f"{acc:.2f} against {base:.2f}", f"{b} vs {c}", f"p = {_mcnemar(b, c):.3f}"

    acc, pair, p = against_baseline("standard", 1024)
    yield "docs/alibi-variants.md", f"({acc}: {pair} prompts right only with the needle, {p},"
    for lo, name in [(1024, "1,024-2,047"), (2048, "2,048-4,095")]:
        acc, pair, p = against_baseline("log", lo)
        yield "docs/alibi-variants.md", f"{name}: {acc}, {pair}, {p}"
    log, std = (trials[m][trials[m]["distance_lo"] >= 1024] for m in ("log", "standard"))
    assert (log[["key", "distance"]].to_numpy() == std[["key", "distance"]].to_numpy()).all()
    b = int((log["top1_correct"].to_numpy() & ~std["top1_correct"].to_numpy()).sum())
    c = int((~log["top1_correct"].to_numpy() & std["top1_correct"].to_numpy()).sum())
    yield (
        "docs/alibi-variants.md",
        f"pooled, {b} vs {c} prompts right for only one of them, p = {_mcnemar(b, c):.3f}",
    )


def reach_claims() -> Iterator[tuple[str, str]]:
    heads = pd.read_csv(FIGURES / "precision/organism_4096_reach.csv")
    ratio = heads["reach_ratio"]
    near = heads[ratio <= 1.5]
    yield (
        "docs/tools/blindness.md",
        f"{len(near)} of {len(heads)} heads look within 1.5x of their slope's reach (ratios "
        f"{near['reach_ratio'].min():.2f}-{near['reach_ratio'].max():.2f})",
    )
    far = heads[ratio > 1.5]
    assert len(far) == 1
    row = far.iloc[0]
    yield (
        "docs/tools/blindness.md",
        f"L{row['layer']:.0f}H{row['head']:.0f} is the exception: {row['reach']:.0f} tokens "
        f"against its slope's {row['reach_baseline']:.0f} ({row['reach_ratio']:.1f}x)",
    )
    zeros = heads[heads["first_zero_distance"].notna()]
    assert (zeros["reach"] < zeros["first_zero_distance"]).all()
    measured = (zeros["first_zero_distance"] / zeros["reach"].clip(lower=1)).median()
    slopes = (zeros["first_zero_distance"] / zeros["reach_baseline"]).median()
    yield (
        "docs/tools/blindness.md",
        f"the {len(zeros)} heads with a float32 zero all look less far than it "
        f"({measured:.0f}x at the median)",
    )
    yield "docs/tools/blindness.md", f"the slopes alone give {slopes:.1f}x"
    yield (
        "docs/tools/blindness.md",
        f"reach median {heads['reach'].median():.0f} tokens, farthest {heads['reach'].max():,.0f}",
    )


def control_natural_claims() -> Iterator[tuple[str, str]]:
    folder = FIGURES / "sinks/control_natural"
    paired = pd.read_csv(folder / "paired.csv").set_index(["experiment", "a", "b"])
    heads = pd.read_csv(folder / "heads.csv").set_index(["experiment", "arm"])
    l0h7, l3h6 = "no bias, wd 0.1: L0H7", "ALiBi, wd 0.1: L3H6"
    sink = paired.loc[(l0h7, "repaired", "control")]
    yield (
        "docs/organisms.md",
        f"within {sink['mean_diff']:+.4f} nats (SE {sink['se']:.4f}; sign test p = "
        f"{sink['sign_p']:.2f})",
    )
    bos = [
        heads.loc[(l0h7, arm), "bos_mass"]
        for arm in ("model as given", "retrained without re-initialisation")
    ]
    yield "docs/organisms.md", f"(BOS mass {bos[0]:.3f} -> {bos[1]:.3f})"
    drops = sorted(
        -paired.loc[(l0h7, arm, "given"), "mean_diff"] for arm in ("repaired", "control")
    )
    yield "docs/organisms.md", f"by {drops[0]:.3f}-{drops[1]:.3f} nats"
    alibi = paired.loc[(l3h6, "repaired", "control")]
    yield (
        "docs/organisms.md",
        f"by {alibi['mean_diff']:+.4f} nats (SE {alibi['se']:.4f}; p = {alibi['sign_p']:.2g})",
    )
    yield "docs/tools/repair.md", f"L0H7 ({sink['mean_diff']:+.4f} nats, SE {sink['se']:.4f})"
    yield "docs/tools/repair.md", f"L3H6 ({alibi['mean_diff']:+.4f}, SE {alibi['se']:.4f})"
    cost = heads.loc[(l0h7, "model as given")]
    yield (
        "docs/organisms.md",
        f"{cost['dloss_mean']:+.4f} ± {cost['dloss_mean_se']:.4f} on 128 other held-out windows",
    )


CLAIMS: list[Callable[[], Iterator[tuple[str, str]]]] = [
    sink_cache_claims,
    natural_collapse_claims,
    retrieval_documents_claims,
    training_numerics_claims,
    retrieval_claims,
    reach_claims,
    control_natural_claims,
]


@pytest.mark.parametrize("claims", CLAIMS, ids=lambda f: f.__name__)
def test_the_docs_quote_the_committed_tables(
    claims: Callable[[], Iterator[tuple[str, str]]],
) -> None:
    for doc, quote in claims():
        assert quote in _flat(doc), f"{doc} should say {quote!r} (from the committed tables)"
