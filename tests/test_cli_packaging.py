"""The configs ship inside the package: a plain (non-editable) install works from any directory."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package():
    """setuptools gets an explicit package list (so that conf/ can become rptrain.conf); a new
    subpackage missing from it would be left out of a non-editable install."""
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "rptrain").rglob("__init__.py")}
    missing, extra = on_disk - declared, declared - on_disk - {"rptrain.conf"}
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"
    assert not extra, f"remove {sorted(extra)} from [tool.setuptools] packages in pyproject.toml"


@pytest.mark.slow
def test_wheel_contains_the_configs_and_runs_from_elsewhere(tmp_path):
    src = tmp_path / "src"
    keep = {"pyproject.toml", "README.md", "rptrain", "conf"}
    shutil.copytree(ROOT, src, ignore=lambda d, names: [n for n in names if (Path(d) == ROOT and n not in keep) or n == "__pycache__"])
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    [wheel] = (tmp_path / "dist").glob("rptrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for name in ("rptrain/conf/config.yaml", "rptrain/conf/model/resnet34.yaml", "rptrain/conf/data/cifar100.yaml",
                 "rptrain/conf/hydra/job_logging/rptrain.yaml", "rptrain/cli/main.py", "rptrain/train/loop.py"):
        assert name in names, name
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", "import rptrain.cli.main as m, sys; print(m.__file__); m.main(sys.argv[1:])",
         "--cfg", "job", "model=llama_tiny", "data=synthetic_tokens"],
        cwd=elsewhere, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(str(site / "rptrain")), proc.stdout[:300]
    assert "name: llama_tiny" in proc.stdout
