"""A small, deterministic stand-in for LLMEngine with the same contract, for fast server tests.

Byte-level tokenizer (token = UTF-8 byte + 3; 0 = <bos>, 1 = <eos>), one generated token per
running request per step, page accounting (pages freed on finish and abort), a configurable
step delay and a switch that makes the next step raise (a dead engine loop).
"""
from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field

from sparseserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from sparseserve.request import SamplingParams

SPECIAL = 3
BOS, EOS = 0, 1
# multi-byte characters on purpose: streamed text must never split them
SCRIPT_TEXT = "héllo wörld, ünïcode 🙂 ok. "
SCRIPT = SCRIPT_TEXT.encode()
# byte offsets where a character starts: generation starts there, so output is valid UTF-8
STARTS = [len(SCRIPT_TEXT[:i].encode()) for i in range(len(SCRIPT_TEXT))]


class FakeTokenizer:
    eos_token_id = EOS
    bos_token_id = BOS
    chat_template = "fake-template"

    def __len__(self) -> int:
        return 256 + SPECIAL

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + SPECIAL for b in text.encode()]
        return ([BOS] if add_special_tokens else []) + ids

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        data = bytes(i - SPECIAL for i in ids if i >= SPECIAL)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, conversation, add_generation_prompt=True, tokenize=True,
                            return_dict=False, chat_template=None, **kw):
        for m in conversation:
            if m["role"] == "tool":
                raise ValueError("this template has no tool role")
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in conversation)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text, add_special_tokens=False) if tokenize else text


@dataclass
class _Seq:
    index: int
    rng: random.Random | None
    pos: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: object = None
    sent_text_bytes: int = 0


@dataclass
class _Req:
    rid: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    seqs: list[_Seq]
    metrics: RequestMetrics
    running: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def num_tokens(self) -> int:
        return len(self.prompt_ids) + max(len(s.tokens) for s in self.seqs)


class FakeEngine:
    def __init__(self, max_model_len: int = 256, max_num_seqs: int = 8, step_delay: float = 0.01,
                 page_size: int = 4, num_pages: int = 4096, model_name: str = "fake-model") -> None:
        self.tokenizer = FakeTokenizer()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.page_size = page_size
        self._num_pages = num_pages
        self._reqs: dict[str, _Req] = {}
        self._order: list[str] = []
        self._pages: dict[str, int] = {}
        self.fail_next_step = False
        self.steps = 0
        self.hits = 0
        self.owner_thread: threading.Thread | None = None  # to assert single-threaded use

    def _check_thread(self) -> None:
        cur = threading.current_thread()
        if self.owner_thread is None:
            self.owner_thread = cur
        assert cur is self.owner_thread, "engine used from two threads"

    # ---- contract --------------------------------------------------------------------------
    def add_request(self, request_id, prompt, params: SamplingParams | None = None, arrival_time=None):
        self._check_thread()
        params = params or SamplingParams()
        params.validate()
        if request_id in self._reqs:
            raise ValueError(f"request id {request_id!r} is already in use.")
        text = None
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("The prompt is empty; give at least one token.")
        if min(ids) < 0 or max(ids) >= len(self.tokenizer):
            raise ValueError(f"prompt token ids must be in [0, {len(self.tokenizer)}).")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"The prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}.")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(room, params.max_tokens)
        seqs = []
        for i in range(params.n):
            if params.greedy:
                pos = STARTS[sum(ids) % len(STARTS)]
            else:  # sampling: a (seeded) random start, then the script in order
                rng = random.Random(None if params.seed is None else params.seed + i)
                pos = STARTS[rng.randrange(len(STARTS))]
            seqs.append(_Seq(i, None, pos))
        self._reqs[request_id] = _Req(request_id, text, ids, params, max_tokens, seqs,
                                      RequestMetrics(arrival_time or time.time()))
        self._order.append(request_id)

    def abort_request(self, request_ids):
        self._check_thread()
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            if self._reqs.pop(rid, None) is not None:
                self._order.remove(rid)
                self._pages.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._reqs)

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        if self.fail_next_step:
            raise RuntimeError("injected engine failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        now = time.time()
        running = [r for r in (self._reqs[i] for i in self._order) if r.running]
        for rid in self._order:
            r = self._reqs[rid]
            if not r.running and len(running) < self.max_num_seqs:
                r.running = True
                r.metrics.first_scheduled_time = now
                running.append(r)
        outputs = []
        for r in running:
            for s in r.seqs:
                if s.finish_reason is None:
                    self._next_token(r, s)
            self._pages[r.rid] = math.ceil(r.num_tokens() / self.page_size)
            r.metrics.first_token_time = r.metrics.first_token_time or now
            r.metrics.last_token_time = now
            if r.finished:
                r.metrics.finished_time = now
            outputs.append(self._output(r, now))
            if r.finished:
                del self._reqs[r.rid]
                self._order.remove(r.rid)
                self._pages.pop(r.rid, None)
        self.steps += 1
        self.hits += len(running)
        return outputs

    def _next_token(self, r: _Req, s: _Seq) -> None:
        p = r.params
        if r.prompt and "EOS" in r.prompt and len(s.tokens) >= 3 and not p.ignore_eos:
            tok = EOS
        else:
            tok = SCRIPT[s.pos % len(SCRIPT)] + SPECIAL
            s.pos += 1
        s.tokens.append(tok)
        if p.logprobs is not None:
            d = {tok: Logprob(-0.25, 1, self.tokenizer.decode([tok]))}
            for j in range(1, p.logprobs):
                alt = SPECIAL + (tok - SPECIAL + j) % 256
                d.setdefault(alt, Logprob(-1.0 - j, j + 1, self.tokenizer.decode([alt])))
            s.logprobs.append(d)
        # incremental text: never end in a broken UTF-8 sequence
        full = self.tokenizer.decode(s.tokens)
        if not full.endswith("\ufffd"):
            before = len(s.text)
            s.text = full
            for stop in p.stop:
                i = s.text.find(stop, max(0, before - len(stop) + 1))
                if i >= 0:
                    s.text = s.text[:i + len(stop)] if p.include_stop_str_in_output else s.text[:i]
                    s.finish_reason, s.stop_reason = "stop", stop
                    return
        if tok == EOS or tok in p.stop_token_ids:
            s.finish_reason, s.stop_reason = "stop", tok
        elif len(s.tokens) >= r.max_tokens:
            s.finish_reason = "length"

    def _output(self, r: _Req, now: float) -> RequestOutput:
        outs = [CompletionOutput(s.index, s.text, list(s.tokens), None,
                                 [dict(d) for d in s.logprobs] if r.params.logprobs is not None else None,
                                 s.finish_reason, s.stop_reason) for s in r.seqs]
        return RequestOutput(r.rid, r.prompt, list(r.prompt_ids), outs, r.finished,
                             RequestMetrics(**vars(r.metrics)), new_token_times=[now] * len(r.seqs))

    def get_stats(self, fresh: bool = True) -> dict:
        used = sum(self._pages.values())
        return {
            "num_running": sum(1 for r in self._reqs.values() if r.running),
            "num_waiting": sum(1 for r in self._reqs.values() if not r.running),
            "num_preemptions_total": 0,
            "device_kv_usage": used / self._num_pages,
            "host_kv_usage": 0.0,
            "cache_hits_total": self.hits,
            "cache_misses_total": self.steps,
            "bytes_loaded_total": 4096 * self.steps,
            "bytes_saved_total": 1024 * self.steps,
            "pages_loaded_total": 2 * self.steps,
            "num_waiting_for_slots": 0,
            "estimated_working_set": 0,
        }

    def check_health(self) -> None:
        pass

    def num_free_pages(self) -> int:
        return self._num_pages - sum(self._pages.values())

    def num_total_pages(self) -> int:
        return self._num_pages
