"""model.weights files that are damaged or hostile: one error naming the file (a ConfigError line and exit 2
through the CLI), never a pickle's code run and never an UnpicklingError or SafetensorError of its own
(exit 1 with the exception's name: issue 31's campaign)."""
from __future__ import annotations

import os

import pytest
import torch

from rptrain.models.llama_weights import read_state_dict


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_payload_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"w": Payload(tmp_path / "pwned")}, path)
    with pytest.raises(ValueError, match=f"{path} cannot be read as weights \\(UnpicklingError"):
        read_state_dict(path)
    assert not (tmp_path / "pwned").exists()


def test_a_truncated_safetensors_file_is_refused_naming_the_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 64)}, path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"{path} cannot be read as weights"):
        read_state_dict(path)
