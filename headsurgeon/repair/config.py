"""A repair run's settings, and the one place they are resolved against the model.

>>> RepairConfig(passes=1).passes
1
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from headsurgeon.backend import Model
from headsurgeon.checkpoints import checkpoint_dtype
from headsurgeon.classify import Thresholds
from headsurgeon.classify.labels import with_thresholds
from headsurgeon.defaults import CENSUS_N_SEQS, CENSUS_SEQ_LEN, DRIFT_THRESHOLD, MAX_PPL_INCREASE
from headsurgeon.dtypes import parse_dtype
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.finetune import FinetuneConfig
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.surgery import INITS
from headsurgeon.validation import MAX_SEED, check_bool, check_choice, check_int, check_number

__all__ = [
    "DRIFT_THRESHOLD",
    "MAX_PPL_INCREASE",
    "RepairConfig",
    "recommended_config",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RepairConfig:
    """Settings of a repair run, validated on creation (see :func:`repair` for each one).

    Census and classification: ``census_seq_len``, ``census_n_seqs``, ``min_query_pos``,
    ``thresholds``. Surgery: ``passes``, ``init``, ``seed``, ``drift_threshold``. Verdict:
    ``max_ppl_increase`` (relative, >= 0; ``math.inf`` ignores perplexity) and
    ``max_collateral`` (frozen heads that may turn sick; see :class:`PassResult`). Data:
    ``train_seq_len`` (default: the model's training length, at most 512), ``n_eval_seqs``,
    ``prepend_bos``, ``eval_on_train`` (held-out text that is training text: refused in one
    line unless True, which judges on it and makes the report say so). Training: ``finetune``
    (default: :func:`recommended_config`) and ``save_dtype`` (default: the checkpoint's dtype,
    else the model's).

    >>> RepairConfig(passes=1).passes
    1
    >>> RepairConfig(passes=0)
    Traceback (most recent call last):
    headsurgeon.errors.InvalidArgumentError: passes must be an integer >= 1, got 0
    """

    passes: int = 2
    init: str = "xavier_normal"
    seed: int = 0
    thresholds: Thresholds = dataclasses.field(default_factory=Thresholds)
    census_seq_len: int = CENSUS_SEQ_LEN
    census_n_seqs: int = CENSUS_N_SEQS
    min_query_pos: int = 1
    prepend_bos: bool | None = None
    train_seq_len: int | None = None
    n_eval_seqs: int = 32
    drift_threshold: float = DRIFT_THRESHOLD
    finetune: FinetuneConfig | None = None
    save_dtype: str | torch.dtype | None = None
    max_ppl_increase: float = MAX_PPL_INCREASE
    max_collateral: int = 0
    control: bool = True
    eval_on_train: bool = False

    def __post_init__(self) -> None:
        if self.finetune is not None:
            self.finetune.validate()
        check_int(self.passes, "passes", minimum=1)
        check_int(self.seed, "seed", minimum=0, maximum=MAX_SEED)
        for name in ("census_seq_len", "census_n_seqs", "n_eval_seqs"):
            check_int(getattr(self, name), name, minimum=1)
        check_int(self.min_query_pos, "min_query_pos", minimum=0)
        if self.train_seq_len is not None:  # a training sequence predicts from position 1 on
            check_int(self.train_seq_len, "train_seq_len", minimum=2)
        if self.prepend_bos is not None:
            check_bool(self.prepend_bos, "prepend_bos")
        check_number(
            self.drift_threshold, "drift_threshold", low=0, high=1, low_open=True, high_open=True
        )
        check_choice(self.init, "init", INITS)
        if not isinstance(self.thresholds, Thresholds):
            raise InvalidArgumentError("thresholds must be a headsurgeon.Thresholds")
        # 0.1 = +10%; inf turns the perplexity limit off.
        check_number(self.max_ppl_increase, "max_ppl_increase", low=0, finite=False)
        check_int(self.max_collateral, "max_collateral", minimum=0)
        check_bool(self.control, "control")
        check_bool(self.eval_on_train, "eval_on_train")


# repair()'s setting keywords: RepairConfig's fields, its ``finetune`` as ``finetune_config``.
# Thresholds' fields as repair() takes them too (headsurgeon.classify.labels.with_thresholds).
_THRESHOLD_KEYWORDS = ("sink_threshold", "dead_threshold", "min_output_share")
_KEYWORDS = {
    ("finetune_config" if f.name == "finetune" else f.name): f.name
    for f in dataclasses.fields(RepairConfig)
}


def resolve_config(
    model: Model, info: ModelInfo, config: RepairConfig | None, keywords: dict[str, Any]
) -> RepairConfig:
    """The complete settings of a run on ``model`` (whose :class:`ModelInfo` is ``info``).

    ``config``, or the one ``keywords`` make (:func:`headsurgeon.repair.repair`'s setting
    keywords: RepairConfig's fields, ``finetune`` as ``finetune_config``, and the thresholds'
    fields by the command line's names, ``sink_threshold``...; an unknown one is one line); not
    both. Then the model fills in what is left open: the fine-tuning settings
    (:func:`recommended_config`), the thresholds (:class:`Thresholds`), the save dtype (the
    checkpoint's, else the model's) and the training length (the model's, at most 512).
    """
    unknown = sorted(set(keywords) - set(_KEYWORDS) - set(_THRESHOLD_KEYWORDS))
    if unknown:
        raise InvalidArgumentError(
            f"repair() has no setting {', '.join(unknown)}; the settings are "
            f"{', '.join(sorted([*_KEYWORDS, *_THRESHOLD_KEYWORDS]))}"
        )
    if config is not None:
        if keywords:  # only the keywords a caller wrote arrive here, so each one was meant
            raise InvalidArgumentError(
                "give the settings either as config= or as keywords, not both "
                f"({', '.join(sorted(keywords))})"
            )
        fields = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    else:
        fields = {_KEYWORDS[k]: v for k, v in keywords.items() if k not in _THRESHOLD_KEYWORDS}
    finetune = (fields.pop("finetune", None) or _recommended(info, None, None, None)).validate()
    named = {k: v for k, v in keywords.items() if k in _THRESHOLD_KEYWORDS}
    thresholds = with_thresholds(fields.pop("thresholds", None), **named)
    config = RepairConfig(finetune=finetune, thresholds=thresholds, **fields)
    n_ctx = model.cfg.n_ctx
    return dataclasses.replace(
        config,
        save_dtype=parse_dtype(config.save_dtype or checkpoint_dtype(model) or model.cfg.dtype),
        train_seq_len=config.train_seq_len or min(512, info.train_ctx or n_ctx, n_ctx),
    )


def recommended_config(
    model: Model,
    config: FinetuneConfig | None = None,
    *,
    steps: int | None = None,
    lr: float | None = None,
) -> FinetuneConfig:
    """``config`` (default: the library defaults) with the steps and learning rate ``model``
    recommends in its ``headsurgeon.json`` (``"repair": {"steps": ..., "lr": ...}``), unless
    given here. The paper's lr 5e-5 suits billion-parameter BLOOMs; a small organism records what
    repairs it. This is what ``python -m headsurgeon repair`` trains with.
    """
    return _recommended(model_info(model), config, steps, lr)


def _recommended(
    info: ModelInfo, config: FinetuneConfig | None, steps: int | None, lr: float | None
) -> FinetuneConfig:
    """:func:`recommended_config` for the model whose :class:`ModelInfo` is ``info``."""
    recommended = info.metadata.get("repair", {})
    explicit = {"steps": steps, "lr": lr}
    chosen = {
        key: recommended[key]
        for key in ("steps", "lr")
        if explicit[key] is None and key in recommended
    }
    if chosen:
        logger.info("using %s's recommended repair settings %s", info.name, chosen)
    given = {key: value for key, value in explicit.items() if value is not None}
    return dataclasses.replace(config or FinetuneConfig(), **chosen, **given).validate()
