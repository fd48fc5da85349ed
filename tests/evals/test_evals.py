"""headsurgeon.evals: perplexity, passkey and needle against exact, oracle and random references."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from headsurgeon.blindness import mitigation
from headsurgeon.data import to_sequences, tokenize
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.evals import needle, passkey, perplexity, retrieval, sliding_windows
from headsurgeon.evals.retrieval import PASSKEY_INTRO, answer_scores
from headsurgeon.loading import model_info
from headsurgeon.long_context import continuation_logprobs

LENGTHS = [192, 256]  # the tiny tokenizer spends ~170 tokens on the passkey prompt itself


class InductionOracle(torch.nn.Module):
    """A perfect retriever: predicts the token that followed the longest earlier match.

    At each position it finds the latest earlier position whose preceding tokens match the
    current suffix longest (up to ``max_n`` tokens) and predicts what came next there. It only
    exposes what the evaluations use besides the forward pass: ``cfg`` and the tokenizer.
    """

    def __init__(self, model, max_n: int = 8):
        super().__init__()
        self.cfg, self.tokenizer = model.cfg, model.tokenizer
        self.headsurgeon_info = model.headsurgeon_info
        self.max_n = max_n

    def forward(self, tokens):
        """Logits: 20 for the predicted token, 0 for every other one."""
        return 20 * self._predict(tokens)

    def _predict(self, tokens):
        out = torch.zeros(*tokens.shape, self.cfg.d_vocab)
        n = tokens.shape[1]
        for b, seq in enumerate(tokens):
            equal = (seq[:, None] == seq[None, :]).tril(-1).long()
            run = torch.zeros(n, n, dtype=torch.long)  # length of the match ending at (t, s)
            run[0] = equal[0]
            for t in range(1, n):
                run[t, 0] = equal[t, 0]
                run[t, 1:] = equal[t, 1:] * (1 + run[t - 1, :-1])
            score = run.clamp(max=self.max_n) * n + torch.arange(n)
            score[run == 0] = -1
            found = score.amax(1) >= 0
            following = seq[(score.argmax(1) + 1).clamp(max=n - 1)]
            out[b, found, following[found]] = 1.0
        return out


def test_perplexity_equals_the_mean_loss_when_rows_fit(tiny_model):
    tokens = torch.randint(4, 300, (3, 40), generator=torch.Generator().manual_seed(0))
    expected = math.exp(tiny_model(tokens, return_type="loss").item())
    assert perplexity(tiny_model, tokens, window=64) == pytest.approx(expected, rel=1e-5)


def test_bos_first_sequences_get_no_second_bos(tiny_model):
    tiny_model.cfg.default_prepend_bos = True
    texts = ["The quick brown fox jumps over the lazy dog. " * 20]
    sequences = to_sequences(tiny_model, texts, seq_len=40, n_seqs=3).tokens
    assert (sequences[:, 0] == tiny_model.tokenizer.bos_token_id).all()
    expected = math.exp(tiny_model(sequences, return_type="loss").item())
    assert perplexity(tiny_model, sequences, window=40) == pytest.approx(expected, rel=1e-5)
    # Without their BOS column they are used as given (one BOS rule for token tensors) ...
    plain = sequences[:, 1:]
    as_given = math.exp(tiny_model(plain, return_type="loss").item())
    assert perplexity(tiny_model, plain, window=40) == pytest.approx(as_given, rel=1e-5)
    # ... unless prepend_bos=True asks for a BOS token in every window: the same perplexity.
    with_bos = perplexity(tiny_model, plain, window=40, prepend_bos=True)
    assert with_bos == pytest.approx(expected, rel=1e-5)


def test_retrieval_prompts_follow_the_bos_convention(tiny_model):
    intro = len(tokenize(model_info(tiny_model), PASSKEY_INTRO))
    for bos in (False, True):
        tiny_model.cfg.default_prepend_bos = bos
        result = passkey(tiny_model, lengths=[192], depths=[0.0], n_trials=1, n_candidates=2)
        assert result.trials.needle_position.tolist() == [intro + bos]


def test_sliding_window_scores_every_token_once_with_its_window_context(tiny_model):
    stream = torch.randint(4, 300, (50,), generator=torch.Generator().manual_seed(1))
    windows = sliding_windows(50, window=20, stride=7)
    assert sum(n for _, _, n in windows) == 49
    nll = 0.0
    for begin, end, n_scored in windows:
        logits = tiny_model(stream[None, begin:end])[0, :-1].log_softmax(-1)
        targets = stream[begin + 1 : end]
        nll -= logits.gather(-1, targets[:, None])[-n_scored:].sum().item()
    assert perplexity(tiny_model, stream, window=20, stride=7) == pytest.approx(
        math.exp(nll / 49), rel=1e-5
    )
    assert perplexity(tiny_model, stream, window=64) == pytest.approx(
        perplexity(tiny_model, stream[None], window=50), rel=1e-6
    )


def test_perplexity_of_text_is_finite_and_above_one(tiny_model):
    ppl = perplexity(tiny_model, ["The quick brown fox jumps over the lazy dog. " * 8], window=32)
    assert 1 < ppl < 400  # a random model over ~320 tokens


def full_sequence_logprobs(model, prompt, continuations):
    """What continuation_logprobs computes, the plain way: prompt + continuation, every row."""
    rows = torch.cat([prompt[None].expand(len(continuations), -1), continuations], dim=1)
    return model(rows).float().log_softmax(-1)[:, len(prompt) - 1 :]


@pytest.mark.parametrize("width", [0, 1, 4])
def test_continuation_logprobs_equal_full_sequence_log_softmax(tiny_model, width):
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(4, 300, (30,), generator=gen)
    continuations = torch.randint(4, 300, (3, width), generator=gen)
    continuations[0, width // 2 :] = 0  # right padding
    got = continuation_logprobs(tiny_model, prompt, continuations)
    assert got.shape == (3, width + 1, tiny_model.cfg.d_vocab) and got.dtype == torch.float32
    torch.testing.assert_close(
        got, full_sequence_logprobs(tiny_model, prompt, continuations), atol=1e-5, rtol=1e-5
    )


def test_oracle_retrieves_perfectly_in_and_out_of_context(tiny_model, monkeypatch):
    # The oracle is no TransformerLens model: it is scored through the plain forward pass.
    monkeypatch.setattr(retrieval, "continuation_logprobs", full_sequence_logprobs)
    # A stand-in for tiny_model, on purpose: its record is tiny_model's.
    monkeypatch.setattr(retrieval, "model_info", lambda model, name: model_info(tiny_model))
    oracle = InductionOracle(tiny_model)
    for task in (passkey, needle):
        result = task(
            oracle,
            lengths=LENGTHS,
            depths=[0.0, 0.5, 1.0],
            n_trials=1,
            n_candidates=4,
            train_ctx=200,
        )
        assert (result.table.greedy_accuracy == 1).all() and (result.table.top1_accuracy == 1).all()
        assert (result.table.mean_rank == 1).all()
        assert result.table.in_context.tolist() == [True] * 3 + [False] * 3
        summary = result.summary.set_index(["metric", "split"]).auc
        assert (summary == 1).all() and len(summary) == 6


def brute_force_scores(model, prompt, candidates):
    """Each candidate after the prompt in a forward of its own, no cache, no padding."""
    loglik, greedy = [], []
    for c in candidates:
        logits = model(torch.cat([prompt, c[:-1]])[None])[0, len(prompt) - 1 :]
        logprobs = logits.log_softmax(-1)
        loglik.append(logprobs.gather(-1, c[:, None]).sum().item())
        greedy.append(bool((logprobs.argmax(-1) == c).all()))
    return torch.tensor(loglik), torch.tensor(greedy)


@pytest.mark.parametrize(
    ("kind", "params"),
    [(None, {}), ("softcap", {"c": 2.0}), ("clamped", {"c": 3.0}), ("log", {})],
)
def test_cached_answer_scores_equal_one_forward_per_candidate(tiny_model, kind, params):
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(4, 300, (70,), generator=gen)
    lengths = [1, 3, 2, 3, 1]
    candidates = [torch.randint(4, 300, (n,), generator=gen) for n in lengths]
    candidates[1] = prompt[10:13]  # one the model may well complete greedily
    with contextlib.ExitStack() as stack:
        if kind:
            stack.enter_context(mitigation(tiny_model, kind, **params))
        loglik, greedy = answer_scores(tiny_model, prompt, candidates)
        expected_loglik, expected_greedy = brute_force_scores(tiny_model, prompt, candidates)
    torch.testing.assert_close(loglik, expected_loglik, atol=1e-4, rtol=1e-5)
    assert torch.equal(greedy, expected_greedy)
    single = answer_scores(tiny_model, prompt, [c[:1] for c in candidates])[0]
    torch.testing.assert_close(
        single,
        brute_force_scores(tiny_model, prompt, [c[:1] for c in candidates])[0],
        atol=1e-4,
        rtol=1e-5,
    )


def test_random_model_is_near_chance(tiny_model):
    result = passkey(
        tiny_model, lengths=LENGTHS, depths=[0.0, 0.5, 1.0], n_trials=4, n_candidates=5, seed=3
    )
    trials = result.trials
    assert len(trials) == 24 and trials.greedy_correct.sum() == 0
    # Chance: top-1 = 1/5 (P(>= 11 of 24) < 1%), mean rank 3 (sd of the mean ~0.3).
    assert trials.top1_correct.mean() < 0.45
    assert 2.2 < trials["rank"].mean() < 3.8
    summary = result.summary.set_index(["metric", "split"])
    assert summary.loc[("top1_accuracy", "all"), "chance"] == pytest.approx(0.2)
    assert math.isnan(summary.loc[("top1_accuracy", "out_of_context"), "auc"])  # no train_ctx


def test_retrieval_runs_under_a_mitigation(tiny_model):
    with mitigation(tiny_model, "log"):
        result = needle(tiny_model, lengths=[128], depths=[0.5], n_trials=2, n_candidates=4)
    assert result.table.n_candidates.tolist() == [4] and result.table.chance.tolist() == [0.25]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: perplexity(m, torch.zeros(2, 8, dtype=torch.long), window=0), "integer >= 1"),
        (
            lambda m: perplexity(m, torch.zeros(2, 8, dtype=torch.long), window=8, stride=8),
            "stride",
        ),
        (lambda m: passkey(m, lengths=[0]), "integer >= 1"),
        (lambda m: passkey(m, lengths=[-64]), "integer >= 1"),
        (lambda m: passkey(m, lengths=[20]), "too short for the passkey prompt"),
        (lambda m: passkey(m, lengths=[256], depths=[1.5]), "depths"),
        (lambda m: passkey(m, lengths=[256], n_trials=0), "n_trials"),
        (lambda m: passkey(m, lengths=[256], n_candidates=1), "n_candidates"),
        (lambda m: needle(m, lengths=[256], words=["a", "b"]), "distinct words"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_model, call, message):
    with pytest.raises(InvalidArgumentError, match=message):
        call(tiny_model)


def test_unusable_data_is_a_data_error(tiny_model):
    with pytest.raises(DataError, match="two tokens"):
        perplexity(tiny_model, torch.zeros(3, 1, dtype=torch.long))


def test_perplexity_scores_at_most_max_windows_evenly_spread(tiny_model):
    rows = torch.randint(4, 300, (10, 24), generator=torch.Generator().manual_seed(3))
    picked = rows[torch.linspace(0, 9, 4).round().long()]
    assert perplexity(tiny_model, rows, max_windows=4) == pytest.approx(
        perplexity(tiny_model, picked, max_windows=None), rel=1e-6
    )
    assert perplexity(tiny_model, rows, max_windows=None) != pytest.approx(
        perplexity(tiny_model, picked), rel=1e-6
    )
    with pytest.raises(InvalidArgumentError, match="max_windows"):
        perplexity(tiny_model, rows, max_windows=0)
