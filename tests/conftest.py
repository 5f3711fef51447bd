import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

DATA = Path(__file__).parent / "data"
CODEBOOK_NAMES = ("3inst", "mcg", "mul1")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="session")
def golden_tiles():
    return load_file(DATA / "exl3_golden.safetensors")


@pytest.fixture(scope="session")
def golden_matrices():
    meta = json.loads((DATA / "exl3_matrix_golden.json").read_text())
    return load_file(DATA / "exl3_matrix_golden.safetensors"), meta["cases"]
