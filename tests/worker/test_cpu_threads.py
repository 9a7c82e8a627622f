"""The CPU engine's per-step thread policy (worker/cpu_threads.py): all cores for steps with
prefill work, one fewer for decode-only steps, off when OMP_NUM_THREADS is set; the engine
applies it every step."""
import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.worker.cpu_threads import CpuThreadPolicy


@pytest.fixture(autouse=True)
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_policy_per_step():
    p = CpuThreadPolicy(cores=2, env={})
    assert p.for_step(True) == 2 and torch.get_num_threads() == 2
    assert p.for_step(False) == 1 and torch.get_num_threads() == 1
    assert p.for_step(True) == 2 and torch.get_num_threads() == 2
    one = CpuThreadPolicy(cores=1, env={})
    assert one.for_step(True) == one.for_step(False) == 1


def test_omp_num_threads_is_the_users_choice():
    torch.set_num_threads(2)
    p = CpuThreadPolicy(cores=4, env={"OMP_NUM_THREADS": "2"})
    assert not p.enabled
    assert p.for_step(False) == 2 and p.for_step(True) == 2 and torch.get_num_threads() == 2


def test_engine_applies_it_each_step(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama-gqa"]
    llm = LLM(path, device="cpu", page_size=16, max_model_len=256, max_num_seqs=4)
    policy = llm.engine.runner.cpu_threads
    if not policy.enabled:
        pytest.skip("OMP_NUM_THREADS is set here: the policy is off")
    seen = []
    real = policy.for_step
    policy.for_step = lambda has_prefill: seen.append((has_prefill, real(has_prefill)))
    llm.generate([{"prompt_token_ids": [5 + i for i in range(40)]}],
                 SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert seen[0] == (True, policy.prefill_threads)  # the prompt's step
    assert all(s == (False, policy.decode_threads) for s in seen[1:]) and len(seen) == 6
