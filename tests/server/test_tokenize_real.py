"""POST /tokenize and /detokenize (vLLM's tokenizer API) on the embedded SmolLM2, against the
same tokenizer and the token counts the completions and chat endpoints report."""
from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.server.helpers import assert_openai_error  # noqa: E402
from tests.server.test_openai_real import CHAT, PROMPT, real  # noqa: E402, F401 (the fixture)


def post(real, path: str, body: dict) -> httpx.Response:
    return httpx.post(real["srv"].base_url + path, json=body, timeout=60)


def test_tokenize_prompt_and_chat_match_the_tokenizer_and_the_usage(real):
    tok = real["engine"].tokenizer
    r = post(real, "/tokenize", {"model": real["model"], "prompt": PROMPT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(PROMPT, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    usage = real["client"].completions.create(model=real["model"], prompt=PROMPT, max_tokens=1,
                                              temperature=0).usage
    assert usage.prompt_tokens == body["count"]  # what the completions endpoint counts
    plain = post(real, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(PROMPT, add_special_tokens=False) and plain["token_strs"] is None

    chat = post(real, "/tokenize", {"messages": CHAT}).json()
    want = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat["tokens"] == list(want)
    usage = real["client"].chat.completions.create(model=real["model"], messages=CHAT, max_tokens=1,
                                                   temperature=0).usage
    assert usage.prompt_tokens == chat["count"]
    no_gen = post(real, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_gen["count"] < chat["count"]


def test_detokenize_round_trips_and_bad_input_is_a_clear_400(real):
    ids = post(real, "/tokenize", {"prompt": "Café 東京 🙂 naïve", "add_special_tokens": False}).json()["tokens"]
    r = post(real, "/detokenize", {"model": real["model"], "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "Café 東京 🙂 naïve"}
    vocab = real["engine"].vocab_size
    err = assert_openai_error(post(real, "/detokenize", {"tokens": [1, vocab, -3]}), 400,
                              param="tokens", code="invalid_token_id")
    assert str(vocab) in err["message"]
    assert_openai_error(post(real, "/tokenize", {"prompt": "x", "messages": CHAT}), 400)
    assert_openai_error(post(real, "/tokenize", {}), 400)
    assert_openai_error(post(real, "/tokenize", {"model": "nope", "prompt": "x"}), 404)
    assert_openai_error(post(real, "/detokenize", {"tokens": "abc"}), 400)


def test_a_model_without_tokenizer_says_so(tiny_model_dirs):
    """Dummy weights have no tokenizer: both endpoints answer 400 and say why."""
    from sparseserve.engine.args import EngineArgs
    from sparseserve.engine.llm_engine import LLMEngine
    from sparseserve.server.api import create_app
    from tests.server.conftest import ServerThread

    path, _ = tiny_model_dirs["llama-gqa"]
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu", dtype="float32",
                                                   max_model_len=128, kv_cache_memory_bytes=1 << 20))
    srv = ServerThread(create_app(engine)).start()
    try:
        for path_, body, param in (("/tokenize", {"prompt": "x"}, "prompt"),
                                   ("/tokenize", {"messages": CHAT}, "messages"),
                                   ("/detokenize", {"tokens": [3, 4]}, "tokens")):
            r = httpx.post(srv.base_url + path_, json=body, timeout=30)
            err = assert_openai_error(r, 400, param=param)
            assert "no tokenizer" in err["message"]
    finally:
        srv.stop()
