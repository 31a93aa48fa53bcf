import pytest

from rptrain.models.hf_names import hf_name, seq_name

CASES = [
    ("0.embed_tokens.weight", "model.embed_tokens.weight"),
    ("1.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("4.mlp.gate_up_proj.weight", "model.layers.3.mlp.gate_up_proj.weight"),
    ("5.norm.weight", "model.norm.weight"),
    ("5.lm_head.weight", "lm_head.weight"),
]


@pytest.mark.parametrize("ours, theirs", CASES)
def test_round_trip(ours: str, theirs: str) -> None:
    assert hf_name(ours, n_layers=4) == theirs
    assert seq_name(theirs, n_layers=4) == ours


@pytest.mark.parametrize("bad", ["6.norm.weight", "x.weight", "model.layers.4.mlp.up_proj.weight", "vision.w"])
def test_refuses_names_outside_the_convention(bad: str) -> None:
    with pytest.raises(ValueError):
        hf_name(bad, 4) if not bad.startswith(("model", "vision")) else seq_name(bad, 4)
