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
    from rptrain.engine.roundpipe import RoundPipe

    close = RoundPipe.close

    def close_and_fail(self):  # a cleanup error after the step's: it must not replace it
        close(self)
        raise RuntimeError("closing broke too")

    monkeypatch.setattr(RoundPipe, "close", close_and_fail)
    run_dir = tmp_path / "run"
    proc = run(walk, "trainer.max_steps=1", f"hydra.run.dir={run_dir}")
    lines = error_lines(proc.stderr)
    assert proc.returncode == 1 and lines == [
        f"rptrain: error: ValueError: the embedding broke (unexpected: the traceback is in {run_dir / 'rptrain.log'})"], explain(proc)
    log = (run_dir / "rptrain.log").read_text()
    assert "Traceback" in log and "closing the run after its error failed too: RuntimeError('closing broke too')" in log
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"


@pytest.fixture(scope="module")
def lora_run(walk):
    """Three LoRA steps of the walkthrough, exporting the adapters alone (adapter/)."""
    root = walk[0]
    proc = run(walk, "model.lora.rank=4", "model.lora.alpha=8", "model.lora.export=adapter", "trainer.max_steps=3",
               "optim.optimizer.lr=1e-2", "precision=fp32", f"hydra.run.dir={root / 'lora'}")
    assert proc.returncode == 0, explain(proc)
    return proc, root / "lora"


def test_lora_runs_say_their_trainable_and_total_parameters(lora_run):
    proc, _ = lora_run
    assert "model hf: 43,168 parameters (4,096 trainable, 9.49%)" in proc.stdout, proc.stdout[-3000:]  # 39,072 + the adapters


def test_rptrain_generate_takes_an_adapter_folder_with_its_base(lora_run, walk, capsys):
    """The adapter folded into its base (adapter_config.json's base_model_name_or_path, or --base) is the
    LoRA run's model: the same loss on a batch (fp32, rel 1e-5) and the same greedy answer."""
    import torch

    from rptrain.cli.generate import load_for_generation, main as generate_cli

    _, run_dir = lora_run
    lora_model, _, _ = load_for_generation(str(run_dir), torch.float32)
    folded, _, template = load_for_generation(str(run_dir / "adapter"), torch.float32)
    base, _, _ = load_for_generation(str(walk[1]), torch.float32)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, plain = (m((ids[:, :-1], ids[:, 1:])).item() for m in (lora_model, folded, base))
    assert got == pytest.approx(want, rel=1e-5) and got != pytest.approx(plain, rel=1e-5)
    answers = []
    for path in (str(run_dir), str(run_dir / "adapter"), f"{run_dir / 'adapter'} --base {walk[1]}"):
        generate_cli([*path.split(), QA[0][0], "--max-tokens", "6"])
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] == answers[2] and answers[0].strip()
    from rptrain.data.chat_template import CHATML

    assert (run_dir / "adapter" / "chat_template.jinja").read_text() == template.source == CHATML  # the fallback trained with


def test_preview_prints_the_first_examples_with_the_trained_tokens_marked(walk, tmp_path):
    proc = run(walk, "--preview", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0 and not (tmp_path / "run").exists(), explain(proc)
    out = proc.stdout
    assert out.startswith(">>> chat template: ChatML, because") and out.count("--- ") == 3
    assert f"<|im_start|>user\n{QA[0][0]}<|im_end|>\n<|im_start|>assistant\n⟦{QA[0][1]}<|im_end|>⟧\n" in out
    bad = rptrain_here(["--preview", "-m", "model=llama_tiny", "data=chat", f"data.path={walk[2]}", "trainer.batch_size=1,2"], walk[0])
    assert bad.returncode == 2 and "--preview takes one run's overrides" in bad.stderr, explain(bad)
