"""Every command the documentation shows runs as written: each fenced `bash` block of README.md and
docs/*.md is read, and each command in it is checked without downloading or training anything:

    rptrain ARGS                      composed and checked as a run would be before it starts (every job
                                      of a -m sweep, the sweeper's search space included), minus the checks
                                      that read files (dataset, model folder, resume checkpoint): preflight
    rptrain --explain/--preview ARGS  composed and checked the same way
    torchrun ... -m rptrain.cli.main ARGS   ARGS as above
    rptrain-export / rptrain-generate     their argument parsers accept the arguments
    sbatch / bash recipes/X.sh        the recipe exists

The first install-and-run command and the test command of README.md are kept exactly as CI reads them.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIRST_RUN = "pip install torch==2.14.1 torchvision==0.29.1 && pip install -e '.[dev]' && rptrain model=resnet34 data=cifar100"

# Commands that cannot be checked here, and why. Empty: every command composes as written.
EXEMPT: dict[str, str] = {}


def bash_commands(page: Path) -> list[tuple[str, list[str]]]:
    """(the line as written, its words) of every command in the page's ```bash blocks: continuation lines
    joined, comments dropped, `a && b` split."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append((line.strip(), words[:cut]))
                words = words[cut + 1:]
    return commands


COMMANDS = [(f"{page.relative_to(ROOT)}: {words[0]} #{i}", line, words)
            for page in PAGES for i, (line, words) in enumerate(bash_commands(page)) if words]


def test_readme_keeps_what_ci_reads():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert blocks[0].strip() == FIRST_RUN
    [ci_tests] = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "-m pytest" in line]
    assert f"```bash\n{ci_tests.replace('python3 ', 'python ', 1)}\n```" in text  # the README's test command is CI's
    assert len(text.splitlines()) <= 80  # a screen or two; the rest is in docs/


def _rptrain_args(words: list[str]) -> list[str]:
    if words[0] == "torchrun":
        return words[words.index("rptrain.cli.main") + 1:]
    return words[1:]


@pytest.mark.parametrize("name, line, words", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_documented_command_composes(name, line, words, monkeypatch):
    if line in EXEMPT:
        pytest.skip(EXEMPT[line])
    tool = words[0]
    if tool in ("pip", "python"):
        return  # installs and the test command: CI runs them
    if tool in ("sbatch", "bash"):
        recipe = next(w for w in words if w.endswith(".sh"))
        assert (ROOT / recipe).is_file(), line
        return
    if tool in ("rptrain-export", "rptrain-generate"):
        from rptrain.cli import export, generate

        module = export if tool == "rptrain-export" else generate
        module._parser().parse_args(words[1:])
        return
    assert tool in ("rptrain", "torchrun"), f"{name}: a command this test does not know how to check: {line}"
    from rptrain.cli import preflight
    from rptrain.train import validate
    from rptrain.train.schema import register_configs

    register_configs()  # what importing rptrain.cli.main does

    args = _rptrain_args(words)
    monkeypatch.setattr(preflight, "check_job", lambda *a, **k: None)  # reads files: dataset, model folder, checkpoint
    monkeypatch.setattr(preflight, "check_loggers", lambda cfg: None)  # wandb is not a test dependency (a heavy wheel)
    flags = [a for a in args if a in ("--explain", "--preview")]
    if flags:
        cfg = preflight.compose_job([a for a in args if a not in flags], flags[0])
        validate.validate_config(cfg)
    else:
        preflight.preflight(args)
