"""Generation: the KV cache gives the logits of recomputing the whole prefix (every decoder switch that
touches attention), and the sampler renders prompts and stops where the turn ends."""
from __future__ import annotations

import pytest
import torch

from rptrain.data import ByteTokenizer
from rptrain.data.chat_template import CHATML, ChatTemplate
from rptrain.models import build_model
from rptrain.models.decoder import build_decoder
from rptrain.models.decoder_config import DecoderConfig
from rptrain.models.generate import generate, kv_cache
from rptrain.models.rope import Rope
from rptrain.train.samples import Sampler, load_prompts

SWITCHES = {
    "llama": {},
    # Gemma-2/3-like: local/global layers, soft-capping, sandwich norms, own scale, qk norms, offset norms.
    "gemma": dict(sliding_window=4, sliding_layers=(True, False), attn_softcap=20.0, sandwich_norms=True, attn_scale=0.3,
                  qk_norm=True, norm_offset=True, local_rope=Rope(theta=100.0), embed_scale=8.0),
    "phi3": dict(fused_qkv=True, fused_gate_up=True, qkv_bias=True),
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_kv_cache_gives_the_logits_of_the_whole_prefix(name):
    """fp32, atol 1e-5: prompt in one call, then one token a call."""
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=97, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=48,
                        **SWITCHES[name])
    model = build_decoder(cfg).eval()
    ids = torch.randint(0, 97, (1, 13))
    with torch.no_grad():
        full = model(ids)[0]
        with kv_cache(model) as cached:
            steps = [model(ids[:, :6])[0]] + [model(ids[:, t : t + 1])[0] for t in range(6, 13)]
    assert cached and not any(type(layer.self_attn).__name__ == "CachedAttention" for layer in list(model)[1:-1])
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=1e-5)
    uncached = generate(lambda x: model(x), ids[0].tolist(), 6)  # a plain callable recomputes the prefix
    assert generate(model, ids[0].tolist(), 6) == uncached


def test_sampler_renders_a_user_turn_and_stops_at_the_end_of_it(tmp_path):
    tok = ByteTokenizer()
    answer = "Paris.<|im_end|>\nmore"
    prompt = ChatTemplate(CHATML).render([{"role": "user", "content": "Capital?"}], add_generation_prompt=True)[0]
    assert prompt == "<|im_start|>user\nCapital?<|im_end|>\n<|im_start|>assistant\n"

    def oracle(ids: torch.Tensor) -> torch.Tensor:
        """Logits that spell `answer` after the rendered prompt, whatever came before."""
        done = ids.size(1) - len(tok.encode(prompt))
        logits = torch.zeros(1, ids.size(1), tok.vocab_size)
        logits[0, -1, tok.encode(answer)[done]] = 1.0
        return logits

    sampler = Sampler(tok, ChatTemplate(CHATML), ["Capital?"], max_tokens=40)
    assert sampler.encode("Capital?") == tok.encode(prompt)
    assert sampler.answer(oracle, "Capital?") == "Paris."  # stopped at <|im_end|>, spelled out in bytes
    assert Sampler(tok, None, []).encode("Capital?") == tok.encode("Capital?")  # text data: the prompt as it is
    path = tmp_path / "prompts.txt"
    path.write_text("one\n\ntwo\n")
    assert load_prompts(path) == ["one", "two"] and load_prompts(["a"]) == ["a"] and load_prompts(None) == []


def test_generation_respects_the_context():
    torch.manual_seed(0)
    model = build_model("llama_tiny", vocab_size=50, max_seq_len=16).eval()
    out = generate(model, list(range(40)), 10, max_seq_len=16)  # the prompt's tail, then what still fits
    assert len(out) == 1


def test_rptrain_generate_on_a_hugging_face_folder_matches_transformers(tmp_path, capsys):
    """Greedy decoding of a tiny Llama folder: every new token is transformers' argmax at that point (up to
    1e-4 in the logits: a random model's logits nearly tie) and the CLI prints their text."""
    transformers = pytest.importorskip("transformers")
    from hf_fixture import llama_folder

    from rptrain.cli.generate import load_for_generation, main as generate_cli

    folder = llama_folder(tmp_path / "llama")
    model, tok, _ = load_for_generation(str(folder), torch.float32)
    prompt = "The quick brown fox"
    sampler = Sampler(tok, None, [prompt], max_tokens=12)
    ids = sampler.encode(prompt)
    assert ids == tok.document(prompt)[:-1] and ids[0] == tok.bos_id  # BOS + text, as documents were framed
    new = generate(model.eval(), ids, 12, sampler._stop)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([ids + new])).logits[0, len(ids) - 1 : -1]
    assert (logits.gather(1, torch.tensor(new)[:, None])[:, 0] >= logits.max(1).values - 1e-4).all()
    generate_cli([str(folder), prompt, "--raw", "--max-tokens", "12", "--device", "cpu"])
    assert capsys.readouterr().out == sampler.answer(model, prompt) + "\n"
