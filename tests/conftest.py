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


@pytest.fixture(scope="module")
def glm5():
    """The synthetic GLM-5-shaped source (metadata only) that planning and pricing tests share."""
    from fq.source import parse_source
    from fq.source_synth import glm5_like

    c, i, s = glm5_like()
    return parse_source(c, i, s, origin="glm5")
