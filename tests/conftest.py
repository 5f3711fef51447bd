import itertools
import json
import os
import tempfile
from pathlib import Path

# Consumers record plan versions in $XDG_STATE_HOME/fq/ by default: never the user's real state, and never one
# shared by tests (a test that re-signs a plan would make a later test's genuine one look like a rollback).
_STATE_ROOT = Path(tempfile.mkdtemp(prefix="fq-test-state-"))
os.environ["XDG_STATE_HOME"] = str(_STATE_ROOT / "session")
_STATE_DIRS = itertools.count()
# fq's per-user cache (fq.core.cache: linear shapes, CUDA builds) in one place per test run, never the user's: warm
# after its first campaign, as a user's is after their first parse. Under xdist the workers of one run share it (one
# directory per run id): a cold entry costs a process that has not imported torch (a Snakemake parse, a plan job)
# about 3.5 s (torch, transformers and the family's decoder layer on the meta device), and each worker paid it again
# for the same demo and demokit configs. Its entries are pure functions of their keys, written atomically.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
os.environ["XDG_CACHE_HOME"] = str(Path(tempfile.gettempdir()) / f"fq-test-cache-{_RUN}" if _RUN
                                   else _STATE_ROOT / "cache")

# Under `make test` two xdist workers share the machine's cores (CI: 2), and each Snakemake job they start is
# another process: one intra-op thread each. Left at torch's default (a thread per core) every process spins
# OpenMP threads against the others, and the suite takes about 1.5x as long on 2 cores. Tests that are about
# thread counts set them explicitly.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# The jobs that do ask for threads (sensitivity and usage: 2) share the cores with the other worker's processes and
# with their own Snakemake's other job. libgomp's default (active) waiting spins a thread at every barrier while the
# thread it waits for has no core: the sensitivity job took 85 s of CPU under the suite for its 28 s alone. Passive
# waiting sleeps instead (same results: only how idle threads wait). Read when libgomp loads, so before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from safetensors.torch import load_file

DATA = Path(__file__).parent / "data"
CODEBOOK_NAMES = ("3inst", "mcg", "mul1")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _own_state_home(monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(_STATE_ROOT / f"test{next(_STATE_DIRS)}"))


@pytest.fixture(scope="session")
def golden_tiles():
    return load_file(DATA / "exl3_golden.safetensors")


@pytest.fixture(scope="session")
def golden_matrices():
    meta = json.loads((DATA / "exl3_matrix_golden.json").read_text())
    return load_file(DATA / "exl3_matrix_golden.safetensors"), meta["cases"]


@pytest.fixture(scope="session")
def pristine_campaign(tmp_path_factory):
    """One valid provkit campaign per test process (tests/kits/provkit.py), never tampered with: see campaign_copy."""
    from tests.kits import provkit

    return provkit.build_campaign(tmp_path_factory.mktemp("pristine-campaign"))


@pytest.fixture
def campaign_copy(pristine_campaign, tmp_path):
    """A private copy of the pristine campaign under tmp_path/c (same key, same tensors) for a test to tamper with:
    what provkit.build_campaign(tmp_path) builds, without building it again."""
    from tests.kits import provkit

    return provkit.private_copy(pristine_campaign, tmp_path / "c")


@pytest.fixture(scope="module")
def hub_offline():
    """Offline for the module that asks for it. huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported:
    import it before the variable is set and patch its constant too, or every later test in this process stays
    offline (the hub promotion tests did, on the same xdist worker)."""
    from huggingface_hub import constants

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("TRANSFORMERS_OFFLINE", "1")
    mp.setattr(constants, "HF_HUB_OFFLINE", True)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def glm5():
    """The synthetic GLM-5-shaped source (metadata only) that planning and pricing tests share."""
    from fq.model.source import parse_source
    from fq.model.source_synth import glm5_like

    c, i, s = glm5_like()
    return parse_source(c, i, s, origin="glm5")



def pytest_configure(config):
    """pytest-xdist (3.x) hands out --dist loadfile's modules by their number of tests, most first, unless told
    otherwise (--no-loadscope-reorder): that put the campaign modules, which have few tests and most of the
    suite's time, last. The schedule is the order below instead."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# The longest modules' seconds on the 2-core dev machine (worker-seconds of a full `-n 2 --dist loadfile` run, summed
# from --durations and rounded): a scheduling hint only. Longest first is what keeps two workers busy to the end (a
# 160 s campaign module that starts last runs alone); modules not listed follow, those with the most slow tests first.
MODULE_SECONDS = {"test_workflow.py": 275, "test_calibration_workflow.py": 245, "test_crash.py": 130,
                  "test_workflow_budget.py": 120, "test_families.py": 95, "test_rehearsal.py": 85,
                  "test_encode_job.py": 65, "test_family_campaigns.py": 50, "test_calibration_affinity.py": 45,
                  "test_deepseek_v4.py": 30, "test_runtime.py": 30, "test_codec_cuda.py": 30,
                  "test_allocation_streamed.py": 30, "test_allocation.py": 25}


def pytest_collection_modifyitems(config, items):
    """Modules in the order of MODULE_SECONDS, then those with the most slow tests (order kept otherwise): under
    `make test`'s xdist (--dist loadfile) a long module that started last would run alone on one core at the end."""
    from collections import Counter

    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: (-MODULE_SECONDS.get(item.path.name, 0), -slow[item.path]))
