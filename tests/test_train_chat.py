"""Chat fine-tuning end to end: packed rows train exactly like padded ones through the engine, a tiny
model learns a chat set written by the test and answers with what it learned (samples.jsonl,
rptrain-generate), and bad chat data stops with one line."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from chat_fixture import make_tokenizer_dir
from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.data import ByteTokenizer, DataError
from rptrain.data.chat import encode_all, pack, pad
from rptrain.data.chat_formats import Conversation
from rptrain.data.chat_template import CHATML, ChatTemplate
from rptrain.models import build_model, count_tokens
from rptrain.optim import Adam
from rptrain.train.data import build_data
from test_cli_errors import cli, expect_error  # noqa: F401  (cli is a fixture)
from test_cli_helpers import explain, read_jsonl, rptrain_here
from test_train_data import make  # noqa: F401  (a fixture: composes a config)

QA = [("What is the capital of France?", "Paris."), ("What do bees make?", "Honey."),
      ("Who wrote Hamlet?", "Shakespeare."), ("How many legs has a spider?", "Eight.")]


def _engine_step(model, batch, num_microbatch: int = 2):
    """One forward_backward of the mean trained-token loss; returns (loss, gradients by name)."""
    engine = RoundPipe(copy.deepcopy(model))
    with OptimizerCtx():  # the master parameters, whose .grad the step function sees
        params = dict(engine.named_parameters())
        Adam(params.values(), lr=1e-3)
    grads = {}
    n = count_tokens(batch[1])
    loss = engine.forward_backward(input_args=(batch,), loss_fn=lambda out, _: out / n,
                                   run_config=RoundPipeRunConfig(num_microbatch=num_microbatch))
    engine.step(lambda: grads.update({k: p.grad.cpu().clone() for k, p in params.items()}), is_async=False)  # GPU share: on the GPU
    engine.close()
    return loss.item(), grads


def test_packed_rows_give_the_loss_and_gradients_of_padded_ones():
    """fp32, rel 1e-5: attention and rotary positions stay inside each packed conversation."""
    single = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in QA]
    double = [m + [{"role": "user", "content": "again"}, {"role": "assistant", "content": m[1]["content"][::-1]}] for m in single]
    convs = [Conversation(m, f"t:{i}") for i, m in enumerate(single + double)]
    pairs = encode_all(convs, ByteTokenizer(), ChatTemplate(CHATML), "assistant", 256, "truncate").pairs
    packed, padded = pack(pairs, 256), pad(pairs)
    assert len(packed[0]) < len(padded[0]) and int(packed[2].max()) > 1  # several conversations share rows
    torch.manual_seed(0)
    model = build_model("llama_tiny", vocab_size=259, loss_chunk_tokens=64)
    loss_packed, grads_packed = _engine_step(model, packed)
    loss_padded, grads_padded = _engine_step(model, padded)
    assert loss_packed == pytest.approx(loss_padded, rel=1e-5)
    for name, g in grads_padded.items():
        torch.testing.assert_close(grads_packed[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_nothing_to_train_on_is_one_data_error(make, tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q}]}) for q, _ in QA))
    cfg = make("model=llama_tiny", "data=chat", f"data.path={path}", "trainer.batch_size=1")
    with pytest.raises(DataError, match=r"no conversation left to train on \(4 conversations .*4 skipped with no trainable tokens"):
        build_data(cfg, torch.float32)


@pytest.mark.slow
def test_a_tiny_model_learns_a_chat_set_and_answers_from_it(tmp_path, capsys):
    folder = make_tokenizer_dir(tmp_path / "tok", template=None)  # no chat_template: the ChatML default
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                              for q, a in QA * 8))
    run = tmp_path / "run"
    proc = rptrain_here(["model=llama_tiny", "data=chat", f"data.path={data}", f"data.tokenizer={folder}", "data.max_seq_len=128",
                         "trainer.batch_size=4", "trainer.max_steps=60", "trainer.log_interval=5", "precision=fp32",
                         "optim.optimizer.lr=3e-3", "trainer.async_step=false", f"trainer.sample_prompts=[{QA[0][0]!r}]",
                         "trainer.sample_max_tokens=8", "trainer.hf_export=false", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert "32 conversations (0 truncated at data.max_seq_len=128, 0 skipped" in proc.stdout and "packed" in proc.stdout
    losses = [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert losses[-1] < 0.2 * losses[0], losses  # the loss counts the answers' tokens only: ln(320) = 5.8 at the start
    samples = read_jsonl(run / "samples.jsonl")
    assert samples[-1] == {"step": 60, "prompt": QA[0][0], "completion": QA[0][1]}, samples[-3:]
    assert f"sample @ step 60: {QA[0][0]!r} -> {QA[0][1]!r}" in proc.stdout
    from rptrain.cli.generate import main as generate

    capsys.readouterr()
    generate([str(run), QA[1][0], "--max-tokens", "8"])
    assert capsys.readouterr().out == f"{QA[1][1]}\n"


def test_bad_chat_and_sample_settings_are_one_line(cli, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": "q", "completion": "a"}) + "\n")
    chat = ["model=llama_tiny", "data=chat", f"data.path={data}"]
    expect_error(cli("model=llama_tiny", "data=chat", f"data.path={tmp_path / 'none.jsonl'}"), "chat data", "does not exist")
    expect_error(cli(*chat, f"trainer.sample_prompts={tmp_path / 'prompts.txt'}"), "trainer.sample_prompts=", "no such file")
    expect_error(cli(*chat, "trainer.sample_temperature=-1"), "trainer.sample_temperature=-1.0 must be >= 0")
    expect_error(cli(*chat, "data.train_on=prompt"), "data.train_on", "expected one of [assistant, completion, all]")
    expect_error(cli(*chat, "data.max_seq_len=512"), "data.max_seq_len=512 is longer than model.max_seq_len=256")
