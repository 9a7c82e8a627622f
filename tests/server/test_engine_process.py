"""The engine in its own process (`sparseserve serve`'s default): outputs rebuilt from deltas
equal the engine's, the same tokens as the engine stepped in a thread, aborts and cuts leave no
page behind, bad input and a dead engine process give clear errors."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from sparseserve import SamplingParams
from sparseserve.engine.args import EngineArgs
from sparseserve.engine.llm_engine import LLMEngine
from sparseserve.server.async_engine import AsyncLLMEngine
from sparseserve.server.engine_errors import EngineDeadError, ServerShutdownError
from sparseserve.server.output_deltas import DeltaAssembler, DeltaEncoder

LENGTHS = (1, 17, 54, 97)  # page edges at page size 16


def free_and_total(engine) -> tuple[int, int]:
    """Runs in the engine process (module level, so it pickles)."""
    return engine.num_free_pages(), engine.num_total_pages()


def prompts(vocab: int = 320) -> list[list[int]]:
    return [[(7 * i + 3 * n) % (vocab - 10) + 5 for i in range(n)] for n in LENGTHS]


def engine_args(model_dir: str) -> EngineArgs:
    return EngineArgs(model=model_dir, device="cpu", dtype="float32", max_model_len=256,
                      kv_cache_memory_bytes=4 << 20, seed=0)


def test_deltas_rebuild_every_output_of_a_real_engine(smollm2_llm):
    """n > 1 with logprobs, prompt logprobs, and a stop string (text the engine cuts back):
    every step's output rebuilt from its delta equals the engine's, and outputs rebuilt
    earlier do not change later."""
    engine = smollm2_llm.engine
    engine.add_request("d-n2", "My favourite food is",
                       SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=13, logprobs=2,
                                      prompt_logprobs=1))
    engine.add_request("d-stop", "Count: 1, 2, 3,",
                       SamplingParams(temperature=0, max_tokens=24, stop=[" 5,", " 6"]))
    enc, asm = DeltaEncoder(), DeltaAssembler()
    rebuilt = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = asm.apply(enc.encode(out))
            assert got == out
            rebuilt.append((got, repr(got)))
    assert {o.request_id for o, _ in rebuilt} == {"d-n2", "d-stop"}
    assert all(repr(o) == r for o, r in rebuilt)  # nothing handed out changed afterwards
    assert not enc._sent and not asm._state  # finished requests leave no state


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    path = str(tmp_path_factory.mktemp("engine_process") / "llama-gqa")
    make_tiny_model(path, "llama-gqa")
    return path


def reference_outputs(model_dir: str, prefix: str, params: SamplingParams) -> dict:
    """The finished outputs of the engine stepped in this process: {prefix + i: output}."""
    ref = LLMEngine.from_engine_args(engine_args(model_dir))
    for i, ids in enumerate(prompts()):
        ref.add_request(f"{prefix}{i}", {"prompt_token_ids": ids}, params)
    want = {}
    while ref.has_unfinished_requests():
        for out in ref.step():
            if out.finished:
                want[out.request_id] = out
    return want


async def _generate(aeng: AsyncLLMEngine, rid: str, ids: list[int], params: SamplingParams):
    stream = await aeng.submit([(rid, {"prompt_token_ids": ids})], params)
    last = None
    async with stream:
        async for _, out in stream:
            last = out
    return last


def test_same_tokens_as_the_engine_in_a_thread_and_no_leaked_pages(tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=9, logprobs=1, ignore_eos=True)
    want = reference_outputs(tiny_dir, "r", params)

    aeng = AsyncLLMEngine.in_engine_process(engine_args(tiny_dir)).start()
    try:
        async def run():
            outs = await asyncio.gather(*(_generate(aeng, f"r{i}", ids, params)
                                          for i, ids in enumerate(prompts())))
            # a stream given up half-way: aborted in the engine process
            stream = await aeng.submit([("gone", {"prompt_token_ids": prompts()[2]})],
                                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
            async with stream:
                async for _, out in stream:
                    if len(out.outputs[0].token_ids) >= 3:
                        break
            for _ in range(100):  # the abort frees its pages on the engine's next step
                free, total = await aeng.call(free_and_total)
                if free == total:
                    break
                await asyncio.sleep(0.05)
            return outs, (free, total)

        outs, (free, total) = asyncio.run(run())
        for i, out in enumerate(outs):
            w = want[f"r{i}"]
            assert out.finished and out.prompt_token_ids == prompts()[i]
            assert out.outputs[0].token_ids == w.outputs[0].token_ids
            assert [d.keys() for d in out.outputs[0].logprobs] == [d.keys() for d in w.outputs[0].logprobs]
        assert free == total, "pages leaked"
        assert aeng.num_running() == 0 and aeng.num_waiting() == 0
    finally:
        aeng.shutdown()
    assert aeng._loop.proc.exitcode == 0


def test_bad_input_lambdas_cut_and_a_dead_engine_process(tiny_dir):
    aeng = AsyncLLMEngine.in_engine_process(engine_args(tiny_dir)).start()
    try:
        async def run():
            with pytest.raises(ValueError, match="max_model_len|longer"):  # the engine's message
                await aeng.submit([("long", {"prompt_token_ids": [5] * 300})],
                                  SamplingParams(max_tokens=4))
            with pytest.raises(TypeError, match="pickle"):
                await aeng.call(lambda e: e.num_free_pages())
            # cut (forced shutdown): the stream ends with ServerShutdownError, pages come back
            stream = await aeng.submit([("cut-me", {"prompt_token_ids": prompts()[1]})],
                                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
            aeng.cut_all()
            with pytest.raises(ServerShutdownError):
                async with stream:
                    async for _ in stream:
                        pass
            assert aeng.num_cut == 1
            for _ in range(100):
                free, total = await aeng.call(free_and_total)
                if free == total:
                    break
                await asyncio.sleep(0.05)
            assert free == total, "pages leaked"

        asyncio.run(run())
    finally:
        aeng.shutdown()

    dead = AsyncLLMEngine.in_engine_process(engine_args(tiny_dir)).start()
    try:
        async def crash():
            stream = await dead.submit([("x", {"prompt_token_ids": prompts()[3]})],
                                       SamplingParams(temperature=0, max_tokens=250, ignore_eos=True))
            os.kill(dead._loop.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exited"):
                async with stream:
                    async for _ in stream:
                        pass

        asyncio.run(crash())
        assert dead.dead_reason is not None
        with pytest.raises(EngineDeadError):
            dead.check_health()
    finally:
        dead.shutdown()


def test_sigterm_past_the_timeout_cuts_streams_served_by_the_engine_process(tiny_dir):
    """`sparseserve serve` as shipped (the engine process): SIGTERM, the shutdown timeout
    passes, the running stream gets its final error event and [DONE], exit code 3, and the
    engine process is gone with the server."""
    import subprocess
    import sys
    import threading

    import httpx

    from tests.server.conftest import free_port
    from tests.server.helpers import sse_events, wait_healthy
    from tests.server.test_sigterm import ROOT

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sparseserve.cli", "serve", tiny_dir,
                             "--port", str(port), "--device", "cpu", "--dtype", "float32",
                             "--max-model-len", "1024", "--kv-cache-memory-bytes", str(4 << 20),
                             "--max-num-seqs", "2", "--shutdown-timeout", "1",
                             "--uvicorn-log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, 120, lambda: proc.stdout.read())
        results, started = [[] for _ in range(6)], threading.Event()

        def stream(lines):
            with httpx.stream("POST", base + "/v1/completions", timeout=60,
                              json={"prompt": prompts()[2], "max_tokens": 900, "stream": True,
                                    "ignore_eos": True}) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()

        threads = [threading.Thread(target=stream, args=(lines,), daemon=True) for lines in results]
        for t in threads:
            t.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, out
    assert "Traceback" not in out and "terminate called" not in out, out
    ends = [sse_events(lines)[-1] for lines in results if lines]  # each ends with [DONE]
    assert any(ev.get("error", {}).get("code") == "server_shutting_down" for ev in ends), ends
    # the engine process ended with the server: nothing named like it is left running
    ps = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    assert not [ln for ln in ps.splitlines() if f" {proc.pid} " in ln and "python" in ln], ps


def test_tensor_parallel_engine_in_its_own_process(tiny_dir):
    """The engine process may start its own rank processes (it is not a daemon): TP=2 over
    gloo gives the greedy tokens of the TP=1 engine."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = {rid: out.outputs[0].token_ids
            for rid, out in reference_outputs(tiny_dir, "t", params).items()}
    import dataclasses
    args = dataclasses.replace(engine_args(tiny_dir), tensor_parallel_size=2)
    aeng = AsyncLLMEngine.in_engine_process(args).start()
    try:
        async def run():
            return await asyncio.gather(*(_generate(aeng, f"t{i}", ids, params)
                                          for i, ids in enumerate(prompts())))

        outs = asyncio.run(run())
    finally:
        aeng.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [want[f"t{i}"] for i in range(len(LENGTHS))]
    assert aeng._loop.proc.exitcode == 0
