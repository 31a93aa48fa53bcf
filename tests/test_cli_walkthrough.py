"""The fine-tuning walkthrough on a small Hugging Face model (max_position_embeddings 256, no chat
template), as a new user runs it: errors that name what the user set, data.max_seq_len following the
model, and an error inside a step shown as itself."""
from __future__ import annotations

import json

import pytest

from hf_fixture import llama_folder
from test_cli_helpers import error_lines, explain, rptrain_here

QA = [("What is the capital of France?", "Paris."), ("What do bees make?", "Honey."),
      ("Who wrote Hamlet?", "Shakespeare."), ("How many legs has a spider?", "Eight.")]


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    """A tiny LlamaForCausalLM folder (256 positions, tokenizer without chat_template) and a chat set."""
    root = tmp_path_factory.mktemp("walk")
    model = llama_folder(root / "model")
    data = root / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                              for q, a in QA * 8))
    return root, model, data


def run(walk, *overrides):
    root, model, data = walk
    return rptrain_here(["model=hf", f"model.path={model}", "data=chat", f"data.path={data}", *overrides], root)


def test_a_wrong_model_path_is_a_model_path_error(walk, tmp_path):
    proc = run(walk, f"model.path={tmp_path / 'missing'}")
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        f"rptrain: error: model.path={tmp_path / 'missing'}: no such folder: point model.path at a Hugging Face model folder "
        f"(config.json, *.safetensors, tokenizer files)"], explain(proc)


def test_a_max_seq_len_the_model_cannot_take_is_refused_naming_it(walk, tmp_path):
    proc = run(walk, "data.max_seq_len=512", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and not (tmp_path / "run").exists(), explain(proc)
    assert error_lines(proc.stderr)[-1].startswith("rptrain: error: data.max_seq_len=512 is longer than") and "256 positions" in proc.stderr


@pytest.fixture(scope="module")
def trained(walk):
    """One step of the walkthrough as written (data.max_seq_len null, hf/ exported)."""
    root = walk[0]
    proc = run(walk, "trainer.max_steps=1", f"hydra.run.dir={root / 'run'}")
    assert proc.returncode == 0, explain(proc)
    return proc, root / "run"


def test_max_seq_len_null_follows_the_model_s_context(trained):
    proc, _ = trained
    assert "at data.max_seq_len=256" in proc.stdout and "sequences of 256" in proc.stdout


def test_the_chatml_fallback_is_said_and_exported_with_the_model(walk, trained):
    """apply_chat_template on the exported folder gives the ids that were trained (the ChatML fallback)."""
    from transformers import AutoTokenizer

    from rptrain.data import load_tokenizer
    from rptrain.data.chat import encode_conversation
    from rptrain.data.chat_formats import Conversation
    from rptrain.data.chat_template import CHATML, ChatTemplate

    proc, run_dir = trained
    _, model, _ = walk
    assert f">>> chat template: ChatML, because {model} has no chat_template" in proc.stdout
    exported = AutoTokenizer.from_pretrained(run_dir / "hf")
    trained_with = load_tokenizer(model), ChatTemplate(CHATML)
    for q, a in QA:
        messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        ids = encode_conversation(Conversation(messages, "t"), *trained_with).ids
        assert exported.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"] == ids
        assert exported.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == \
            ChatTemplate(CHATML).render(messages[:1], add_generation_prompt=True)[0]


def test_an_error_inside_a_step_is_shown_as_itself_once(walk, tmp_path, monkeypatch):
    """Not the engine's note about discarded gradients, not a cleanup error: the error, as the last line."""
    from rptrain.models import decoder

    def broken(self, batch):
        raise ValueError("the embedding broke")

    monkeypatch.setattr(decoder.TokenEmbedding, "forward", broken)
    run_dir = tmp_path / "run"
    proc = run(walk, "trainer.max_steps=1", f"hydra.run.dir={run_dir}")
    lines = error_lines(proc.stderr)
    assert proc.returncode == 1 and lines == [
        f"rptrain: error: ValueError: the embedding broke (unexpected: the traceback is in {run_dir / 'rptrain.log'})"], explain(proc)
    assert "Traceback" in (run_dir / "rptrain.log").read_text()
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
