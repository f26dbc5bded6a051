"""inside on the families `models/more.py` adds (Llama, Qwen2, Whisper, wav2vec2, Swin,
DeBERTa-v2, BART, DistilBERT), as a researcher looks at one before training it: what each look
says is checked against the model itself and against float64 computations by hand."""

from __future__ import annotations

import math

from models.more import CASES

from somatize.torch import probe, proxies


def test_probe_of_a_model_given_labels_follows_what_it_gives_not_the_loss_it_puts_first():
    """A transformers model given `labels` puts its loss before its logits: the probe's
    cotangent is on what the model gives (its logits, its states), so every place's numbers
    are those it has without the labels."""
    case = CASES["llama"]()
    plain = probe(case.model, case.example, most=100)
    labelled = probe(case.model, {**case.example, "labels": case.target}, most=100)
    assert plain.keys() <= labelled.keys()  # and the loss's own places
    assert "jacobian_gain" in plain["llamaforcausallm.lm_head"]
    for where, numbers in plain.items():
        assert numbers.keys() == labelled[where].keys(), where
        for name, value in numbers.items():
            got = labelled[where][name]
            if isinstance(value, float):
                assert math.isclose(got, value, rel_tol=1e-5, abs_tol=1e-9), (where, name)
            else:
                assert got == value, (where, name)


def test_proxies_of_a_model_given_labels_score_what_it_gives_not_the_loss_it_puts_first():
    """Whisper given `labels` puts its loss before its logits and the encoder's states: synflow
    sums what the net gives, zen and jacob_cov perturb it, and none of them reads that loss, so
    each scores what it scores without the labels."""
    case = CASES["whisper"]()
    plain = proxies(case.model, case.example)
    labelled = proxies(case.model, {**case.example, "labels": case.target})
    assert set(plain) == {"synflow", "zen", "naswot", "jacob_cov"} == set(labelled)
    for name, score in plain.items():
        assert math.isclose(labelled[name], score, rel_tol=1e-9), name
