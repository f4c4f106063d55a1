"""``python -m tinyserve_compile.serve`` on 127.0.0.1, load-tested through its OpenAI-compatible HTTP API with the
``openai`` client: concurrent requests are all answered once, each equal to that prompt decoded alone through the
static-cache backend; bad requests get clear errors and a client that leaves mid-stream disturbs nobody."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from tinyserve_compile.serve import check_request, serve_args

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from cb_helpers import static_alone  # noqa: E402
from bench.serve_http import save_tiny_model  # noqa: E402

#: sparse with these prompts (20-150 tokens): 2 pages of budget, 2 extra candidate pages
OPTIONS = {"token_budget": 16, "page_size": 8, "candidate_extra": 16}
N_NEW = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny_model"))
    save_tiny_model(folder)
    port = _free_port()
    log = open(os.path.join(folder, "server.log"), "w")
    cmd = [sys.executable, "-m", "tinyserve_compile.serve", folder, "--options", json.dumps(OPTIONS), "--port",
           str(port), "--cb-block-size", "16", "--cb-num-blocks", "96", "--cb-max-batch-tokens", "96",
           "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, open(log.name).read()[-3000:]
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start in 300 s"
        time.sleep(1)
    yield url, folder, log.name
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _prompts(folder, lengths, seed=0):
    """Prompts of about ``lengths`` tokens: slices of seeded random words that tokenize back to themselves."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "self", "print", "value", "index", "list"]
    out = []
    for n in lengths:
        text = " ".join(words[int(i)] for i in torch.randint(len(words), (n,), generator=g))
        out.append((text, tok(text).input_ids))
    return tok, out


def test_concurrent_requests_are_all_answered_and_exact(server):
    url, folder, log = server
    tok, prompts = _prompts(folder, [20, 45, 70, 150, 110, 130, 35, 90], seed=1)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)

    def ask(i):
        text, _ = prompts[i]
        r = client.completions.create(model=folder, prompt=text, max_tokens=N_NEW, temperature=0)
        return i, r

    with cf.ThreadPoolExecutor(5) as pool:  # 5 users at once, 8 requests
        answers = dict(pool.map(ask, range(len(prompts))))
    assert sorted(answers) == list(range(len(prompts)))  # every request answered once
    assert len({r.id for r in answers.values()}) == len(prompts)  # no answer duplicated
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    for i, (text, ids) in enumerate(prompts):
        r = answers[i]
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == N_NEW
        want = static_alone(model, ids, N_NEW, {**OPTIONS, "lower": "eager"})
        assert r.choices[0].text == tok.decode(want), f"request {i} ({len(ids)} tokens)"
    assert "continuous batching through tinyserve" in open(log).read()


def test_bad_requests_get_errors_and_disturb_nobody(server):
    url, folder, _ = server
    tok, prompts = _prompts(folder, [40, 75, 120], seed=2)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    want = [tok.decode(static_alone(model, ids, N_NEW, {**OPTIONS, "lower": "eager"})) for _, ids in prompts]

    def good(i):
        return client.completions.create(model=folder, prompt=prompts[i][0], max_tokens=N_NEW,
                                         temperature=0).choices[0].text

    def leave_mid_stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=600,
                          json={"model": folder, "prompt": prompts[2][0], "max_tokens": 200, "stream": True}) as r:
            for _ in r.iter_lines():
                return r.status_code  # the first chunk, then the client hangs up

    def bad(body):
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return httpx.post(url + route, json=body, timeout=600)

    with cf.ThreadPoolExecutor(6) as pool:
        goods = [pool.submit(good, i) for i in range(3)]
        left = pool.submit(leave_mid_stream)
        refused = {  # request -> the words its error must contain
            "'max_tokens' must be a positive integer": {"model": folder, "prompt": prompts[0][0], "max_tokens": "many"},
            "'temperature' must be a number": {"model": folder, "prompt": prompts[0][0], "temperature": "hot"},
            "'prompt' must be a non-empty": {"model": folder, "max_tokens": 4},
            "'prompt' must not be empty": {"model": folder, "prompt": "", "max_tokens": 4},  # kills stock CB's worker
            "exceeds the model's context of 2048 tokens": {"model": folder, "prompt": "alpha " * 3000,
                                                          "max_tokens": 4},
            "'messages' must be a non-empty list": {"model": folder, "messages": []},
        }
        futures = {why: pool.submit(bad, body) for why, body in refused.items()}
        assert [g.result() for g in goods] == want
        assert left.result() == 200
    for why, f in futures.items():
        r = f.result()
        assert r.status_code == 400 and why in r.json()["error"], (why, r.status_code, r.text[:300])
    # the server still answers, exactly, after all that
    assert good(1) == want[1]


def test_request_checks_name_the_field():
    class Tok:
        def __call__(self, text):
            return type("Enc", (), {"input_ids": text.split()})()

    ok = {"prompt": "a b c", "max_tokens": 4}
    assert check_request("/v1/completions", ok, Tok(), 10) is None
    assert "exceeds the model's context of 6" in check_request("/v1/completions", ok, Tok(), 6)
    assert check_request("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}) is None
    assert "'prompt'" in check_request("/v1/completions", {"prompt": [1, "x"]})
    assert "'max_tokens'" in check_request("/v1/completions", {"prompt": "a", "max_tokens": 0})
    assert "'max_tokens'" in check_request("/v1/completions", {"prompt": "a", "max_tokens": True})
    assert "'top_p'" in check_request("/v1/chat/completions", {"messages": [{}], "top_p": "x"})
    assert "JSON object" in check_request("/v1/completions", [1])
    assert serve_args("m", ["--port", "1"]) == ["serve", "m", "--continuous-batching", "--port", "1", "--host",
                                                "127.0.0.1"]
    assert serve_args("m", ["--host", "0.0.0.0"])[-2:] == ["--host", "0.0.0.0"]


def test_gguf_config_gets_its_causal_lm_class_while_the_server_loads():
    # transformers' GGUF loader leaves config.architectures None, and `transformers serve` indexes it: the
    # server's load gives a GGUF config its causal-LM class, only while it loads
    from transformers import AutoConfig

    from tinyserve_compile.serve import _gguf_architecture
    from tinyserve_compile.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    assert AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).architectures is None
    with _gguf_architecture():
        cfg, unused = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, return_unused_kwargs=True)
        assert cfg.architectures == ["LlamaForCausalLM"]
    assert AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).architectures is None


def test_an_unsupported_transformers_serve_is_refused_with_the_reason(monkeypatch, capsys):
    # transformers 5.25 redesigned `transformers serve` (a process per model): the entry point says so instead of
    # failing on a missing attribute of its model manager
    import transformers

    from tinyserve_compile.serve import main

    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    with pytest.raises(SystemExit) as e:
        main(["some/model"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "supports transformers 5.24.x" in err and "installed: 5.25.0" in err
