"""The server through real HTTP clients: the official ``openai`` client and httpx."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import numpy as np
import pytest

from .conftest import CONTEXT, MODEL

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.compile

LENGTHS = (3, 9, 17, 30, 41, 58, 77, 100)  # 8 prompts of different lengths, some chunked (chunk 32)
NEW = 12


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(3, vocab, n)] for n in LENGTHS]


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def _client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=120)


def _complete(served, prompt: list[int], **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True} | kw
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(served, prefix: str) -> float:
    text = httpx.get(f"{served.url}/metrics", timeout=10).text
    line = next(ln for ln in text.splitlines() if ln.startswith(prefix))
    return float(line.rsplit(" ", 1)[1])


def _pages_in_use(served) -> float:
    return _metric(served, "sandwich_kv_cache_pages_used{")


@pytest.fixture(autouse=True)
def _pages_accounted_for(served):
    """After every test, once idle: no page in use, and used + cached + free = total."""
    yield
    deadline = time.monotonic() + 30
    while _pages_in_use(served) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    parts = [_metric(served, f"sandwich_kv_cache_pages_{k}{{") for k in ("used", "cached", "free", "total")]
    assert parts[0] == 0 and parts[0] + parts[1] + parts[2] == parts[3] > 0


def test_a_shared_prefix_is_served_from_the_cache(served):
    client = _client(served)
    rng = np.random.default_rng(8)
    system = [int(t) for t in rng.integers(3, served.engine.cfg.vocab_size, 100)]
    hits = _metric(served, "sandwich_prefix_cache_hits{")
    ask = [system + [int(t) for t in rng.integers(3, 50, n)] for n in (5, 11)]
    first = client.completions.create(model=MODEL, prompt=ask[0], max_tokens=NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
    second = client.completions.create(model=MODEL, prompt=ask[1], max_tokens=NEW, temperature=0,
                                       extra_body={"ignore_eos": True})
    page = served.engine.page_size
    assert second.usage.prompt_tokens_details.cached_tokens == 100 // page * page
    assert _metric(served, "sandwich_prefix_cache_hits{") - hits >= 100 // page * page
    uncached = _complete(served, ask[1], cache_prompt=False)
    assert uncached["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert uncached["choices"][0]["text"] == second.choices[0].text
    assert second.choices[0].text == served.tok.decode(_hf_greedy(served.hf, ask[1], NEW))
    assert first.usage.prompt_tokens_details.cached_tokens < 100 // page * page  # the first paid in full


def test_batching_changes_nothing(served):
    """8 concurrent greedy requests = each alone through the server = HF transformers."""
    prompts = _prompts(served.engine.cfg.vocab_size)
    alone = [_complete(served, p)["choices"][0]["text"] for p in prompts]
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: _complete(served, p)["choices"][0]["text"], prompts))
    assert together == alone
    expected = [served.tok.decode(_hf_greedy(served.hf, p, NEW)) for p in prompts]
    assert alone == expected
    assert _pages_in_use(served) == 0


def test_openai_client_streaming_and_not(served):
    client = _client(served)
    prompt = _prompts(served.engine.cfg.vocab_size)[3]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == NEW and full.usage.prompt_tokens == len(prompt)
    assert full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == NEW
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    rendered = served.tok.encode("[user] hello\n[assistant] ")
    assert chat.usage.prompt_tokens == len(rendered)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=5, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_sampling_through_the_api(served):
    prompt = _prompts(served.engine.cfg.vocab_size)[2]
    a = _complete(served, prompt, temperature=1.0, seed=5, top_p=0.9, max_tokens=8)
    b = _complete(served, prompt, temperature=1.0, seed=5, top_p=0.9, max_tokens=8)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # a seed reproduces
    greedy = _complete(served, prompt, logprobs=2)
    lp = greedy["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == NEW and all(x <= 0 for x in lp["token_logprobs"])
    # keyed by token text (OpenAI's shape): byte tokens that decode alike share a key
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"])
    # a stop string cut inside the text: the output ends right before it
    text = greedy["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = _complete(served, prompt, stop=[stop])
    assert cut["choices"][0]["text"] == text[:text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    # EOS honoured unless ignore_eos: a stop token id ends the request without text
    first = _hf_greedy(served.hf, prompt, 1)[0]
    ended = _complete(served, prompt, stop_token_ids=[first])
    assert ended["choices"][0]["finish_reason"] == "stop" and ended["usage"]["completion_tokens"] == 1
    assert ended["choices"][0]["text"] == ""
    # logit_bias: +100 forces a token at every step, even greedy; -100 bans one; ids outside the
    # vocabulary are a 400
    assert _complete(served, prompt, logit_bias={"300": 100})["choices"][0]["text"] == "t300" * NEW
    one = {"max_tokens": 1, "logprobs": 0}
    plain = _complete(served, prompt, **one)["choices"][0]["logprobs"]["tokens"][0]
    banned = _complete(served, prompt, logit_bias={str(first): -100}, **one)["choices"][0]["logprobs"]
    assert banned["tokens"][0] != plain
    r = httpx.post(f"{served.url}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": prompt, "logit_bias": {"99999": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": "many"}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": -1}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 100000}', 400, f"{CONTEXT} tokens"),
    (b'{"model": "other", "prompt": "hi"}', 404, "does not exist"),
    (b'{"model": "tiny"}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": [1, 2, 99999]}', 400, "vocabulary"),
])
def test_bad_requests_get_openai_errors(served, body, status, needle):
    r = httpx.post(f"{served.url}/v1/completions", content=body, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


def test_tokenize_gives_the_ids_a_request_is_served_and_detokenize_their_text(served):
    """vLLM's /tokenize and /detokenize: a completion prompt's ids (BOS as a completion gets it)
    and a chat's (through the template) count as the served requests' usage does; ids give
    their text back; wrong bodies are 400s naming the field, another model a 404."""
    post = lambda path, body: httpx.post(f"{served.url}{path}", json=body, timeout=60)  # noqa: E731
    text = "hello tokens"
    r = post("/tokenize", {"model": MODEL, "prompt": text}).json()
    assert r["tokens"] == served.tok.prompt_ids(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == CONTEXT
    done = post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == r["count"]
    messages = [{"role": "user", "content": "hi there"}]
    chat = post("/tokenize", {"messages": messages}).json()
    served_chat = post("/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == served_chat["usage"]["prompt_tokens"] > r["count"]
    plain = post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert plain == served.tok.encode(text)
    assert post("/detokenize", {"tokens": plain}).json() == {"prompt": text}
    for path, body, status, field in [
            ("/tokenize", {"prompt": "a", "messages": messages}, 400, "prompt"),
            ("/tokenize", {}, 400, "prompt"),
            ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
            ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens"),
            ("/detokenize", {"tokens": "1 2"}, 400, "tokens")]:
        bad = post(path, body)
        assert bad.status_code == status and bad.json()["error"]["param"] == field, (body, bad.text)


def test_long_prompt_names_the_limit(served):
    r = httpx.post(f"{served.url}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": [5] * (CONTEXT + 10), "max_tokens": 1})
    assert r.status_code == 400 and str(CONTEXT) in r.json()["error"]["message"]


def test_burst_disconnects_and_recovery(served, monkeypatch):
    """Past the queue bound some requests get 429 with Retry-After; clients that vanish cancel
    their sequences; afterwards the server answers and no KV page is in use."""
    step = served.batch.step

    def slow_step():  # the tiny model finishes 200 tokens before a client could leave
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(served.batch, "step", slow_step)
    prompts = _prompts(served.engine.cfg.vocab_size)
    prompt = prompts[5]

    def one(i: int) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        if i % 3 == 0:  # leave mid-stream, long before the 200th token
            long = body | {"prompt": prompts[2], "max_tokens": 200, "stream": True}
            try:
                with httpx.stream("POST", f"{served.url}/v1/completions", json=long, timeout=60) as r:
                    for _ in zip(range(3), r.iter_lines(), strict=False):
                        pass
                return -1
            except httpx.HTTPError:
                return -2
        r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
        if r.status_code == 429:
            assert r.headers.get("retry-after") and r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 40
        return r.status_code

    aborted = _metric(served, 'sandwich_request_success_total{model="tiny",reason="abort"}')
    with cf.ThreadPoolExecutor(24) as pool:
        codes = list(pool.map(one, range(24)))
    assert 429 in codes and 200 in codes
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
    _complete(served, prompt)  # still serving
    deadline = time.monotonic() + 10
    while _pages_in_use(served) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pages_in_use(served) == 0
    assert served.batch.scheduler.running == [] and not served.batch.scheduler.waiting
    # the clients that left mid-stream were cancelled, not run to their 40 tokens
    assert _metric(served, 'sandwich_request_success_total{model="tiny",reason="abort"}') > aborted
    assert _metric(served, 'sandwich_request_success_total{model="tiny",reason="length"}') > 0
