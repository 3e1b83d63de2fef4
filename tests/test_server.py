"""The OpenAI-compatible server (``pagedspec serve``) driven by the official ``openai`` client
and raw HTTP, on a tiny random checkpoint served from a background thread on 127.0.0.1.

Greedy outputs must equal the offline ``LLM``'s for the same prompts, whatever else runs
concurrently; a client that disconnects is aborted and its KV blocks freed while other streams
go on unchanged; ``/metrics`` counters move by what the requests did; every bad request gets its
status and a message naming the parameter while a good request beside it completes unchanged.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from checkpoints import make_checkpoint
from pagedspec import LLM, SamplingParams
from pagedspec.engine.config import EngineConfig

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pagedspec.serve.app import create_engine_and_app, make_parser  # noqa: E402
from pagedspec.serve.app import main as serve_main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_MODEL_LEN = 512
PROMPTS = ["def fibonacci(n):", "import os, sys", "class Stack:\n    def push(self, item):",
           "print(", "    return a", "a, b = b, a", "self.items", "for _ in range(n):"]
# A chat template in the style of the ones checkpoints ship (bos written by the template, roles
# checked with raise_exception), rendered by transformers in the chat test for comparison.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('the system message must come first') }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GREEDY = dict(temperature=0.0, ignore_eos=True)
TIMEOUT = 60.0       # seconds; every wait in this file is bounded by it


@dataclass
class Server:
    base_url: str
    engine: object        # the AsyncEngine
    name: str

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0,
                             timeout=TIMEOUT)

    def metrics(self) -> dict:
        """{(sample name, sorted label items): value} of ``GET /metrics``."""
        text = httpx.get(self.base_url + "/metrics", timeout=TIMEOUT).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def counter(self, metrics: dict, name: str, **labels) -> float:
        key = (f"pagedspec:{name}", tuple(sorted({"model_name": self.name, "engine": "0",
                                                  **labels}.items())))
        return metrics.get(key, 0.0)

    def wait_idle(self) -> None:
        """Until the engine holds no request (bounded)."""
        core = self.engine.engine.core
        deadline = time.monotonic() + TIMEOUT
        while core.requests or self.engine.num_unfinished():
            assert time.monotonic() < deadline, f"still running: {list(core.requests)}"
            time.sleep(0.01)


@contextlib.contextmanager
def running_server(config: EngineConfig, name: str, max_waiting=None):
    """The app on a free port of 127.0.0.1, served by uvicorn in a background thread (which
    installs no signal handlers there)."""
    app, engine = create_engine_and_app(config, name, max_waiting)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield Server(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, name)
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        engine.shutdown()
        sock.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # scale_outputs makes greedy text repeat (n-gram drafts get accepted); logit_scale keeps the
    # argmaxes clear, so that batch-dependent float32 rounding never flips a greedy token
    path = make_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", "llama", seed=5,
                           scale_outputs=0.3, max_position_embeddings=MAX_MODEL_LEN)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)


def engine_config(path, **overrides) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", device="cpu",
                        max_model_len=MAX_MODEL_LEN, **overrides)


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server(engine_config(checkpoint), "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def spec_server(checkpoint, tmp_path_factory):
    """n-gram speculation, on a copy of the checkpoint without a chat template."""
    plain = tmp_path_factory.mktemp("plain") / "tiny"
    shutil.copytree(checkpoint, plain)
    (plain / "chat_template.jinja").unlink()
    with running_server(engine_config(plain, speculative_model="ngram",
                                      num_speculative_tokens=3, speculative_adaptive=False),
                        "tiny-spec") as s:
        yield s


def offline(llm, prompts, **params):
    """The offline LLM's completions (CompletionOutput per prompt, n=1)."""
    outs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [o.outputs[0] for o in outs]


def stream_completion(client, **kwargs) -> tuple[str, list]:
    """Concatenated text and the chunks of a streamed completion (n=1)."""
    chunks = list(client.completions.create(stream=True, **kwargs))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


# ---- completions ------------------------------------------------------------------------------
def test_models_health_and_cli_defaults(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.base_url + "/health").status_code == 200
    args = make_parser().parse_args(["--model", "m"])
    assert (args.host, args.port, args.max_waiting) == ("127.0.0.1", 8000, None)
    assert args.max_num_seqs == EngineConfig.max_num_seqs      # engine flags come along


def test_pagedspec_serve_command_serves_and_stops_on_interrupt(checkpoint, tmp_path, capsys):
    import os
    import signal
    import subprocess
    import sys

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pagedspec", "serve", "--model", str(checkpoint),
               "--port", str(port), "--served-model-name", "cli-tiny", "--max-waiting", "4",
               "--dtype", "float32", "--max-num-seqs", "4", "--log-level", "warning"]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        try:
            deadline = time.monotonic() + TIMEOUT
            while True:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "pagedspec serve did not come up"
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                time.sleep(0.1)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=TIMEOUT,
                           json={"model": "cli-tiny", "prompt": PROMPTS[0], "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
            proc.send_signal(signal.SIGINT)
            assert proc.wait(TIMEOUT) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    # a model that cannot be loaded: a message and exit status 2, before anything listens
    assert serve_main(["--model", str(tmp_path / "missing"), "--port", str(port)]) == 2
    assert "missing" in capsys.readouterr().err


@pytest.mark.parametrize("max_tokens", [1, 9, 33])
def test_completion_equals_offline_llm_with_usage(server, llm, max_tokens):
    prompt = random.Random(max_tokens).choice(PROMPTS)
    expected = offline(llm, [prompt], max_tokens=max_tokens, **GREEDY)[0]
    resp = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, extra_body={"ignore_eos": True})
    (choice,) = resp.choices
    assert choice.text == expected.text and choice.finish_reason == "length"
    assert resp.object == "text_completion" and resp.model == "tiny"
    assert resp.usage.prompt_tokens == len(llm.tokenizer.encode(prompt).ids)
    assert resp.usage.completion_tokens == max_tokens
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + max_tokens


def test_batched_prompts_token_ids_and_n(server, llm):
    ids = [llm.tokenizer.encode(p).ids for p in PROMPTS[:2]]
    prompts = [ids[0], ids[1][1:]]      # token ids as they are: the second without bos
    resp = server.client().completions.create(model="tiny", prompt=prompts, max_tokens=6, n=3,
                                              temperature=1.0, seed=11,
                                              extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == list(range(6))
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 6 * 6
    assert resp.usage.prompt_tokens == len(ids[0]) + len(ids[1]) - 1
    # seeded sampling: the same request again gives the same choices, and n samples differ
    again = server.client().completions.create(model="tiny", prompt=prompts, max_tokens=6, n=3,
                                               temperature=1.0, seed=11,
                                               extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    assert len({c.text for c in resp.choices[:3]}) > 1


def test_concurrent_streams_equal_offline_llm(server, llm):
    lengths = [5 + 7 * i for i in range(len(PROMPTS))]
    expected = [offline(llm, [p], max_tokens=n, **GREEDY)[0] for p, n in zip(PROMPTS, lengths)]

    def run(i):
        chunks = list(server.client().completions.create(
            model="tiny", prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        return chunks

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(run, range(len(PROMPTS))))
    for i, chunks in enumerate(results):
        *body, usage_chunk = chunks
        assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == lengths[i]
        assert all(c.usage is None for c in body)
        assert "".join(c.choices[0].text for c in body) == expected[i].text, PROMPTS[i]
        assert [c.choices[0].finish_reason for c in body][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in body[:-1])
        assert len({c.id for c in chunks}) == 1


def test_stop_string_split_across_tokens(server, llm):
    """A stop string made of the end of one token and the start of the next: the text stops
    before it, streamed or not, and no chunk ever sends a piece of it."""
    prompt = PROMPTS[2]
    full = offline(llm, [prompt], max_tokens=40, **GREEDY)[0]
    ids = full.token_ids
    offsets = [len(llm.tokenizer.decode(ids[:j])) for j in range(len(ids) + 1)]
    stop = cut = None
    for j in range(1, len(ids) - 1):
        b = offsets[j]
        if offsets[j - 1] < b < offsets[j + 1]:
            candidate = full.text[b - 1:b + 1]
            if full.text.find(candidate) == b - 1 and candidate.strip():
                stop, cut = candidate, b - 1
                break
    assert stop is not None, f"no token boundary to split a stop string over in {full.text!r}"
    client = server.client()
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                  stop=[stop, "never-appears"], extra_body={"ignore_eos": True})
    resp = client.completions.create(**kwargs)
    assert resp.choices[0].text == full.text[:cut]
    assert resp.choices[0].finish_reason == "stop"
    text, chunks = stream_completion(client, **kwargs)
    assert text == full.text[:cut] and chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(server, llm):
    prompt, k = PROMPTS[1], 3
    expected = offline(llm, [prompt], max_tokens=8, logprobs=k, **GREEDY)[0]
    client = server.client()
    for stream in (False, True):
        kwargs = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=k,
                      extra_body={"ignore_eos": True})
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)]
            token_logprobs = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
            tops = [x for c in chunks if c.logprobs for x in c.logprobs.top_logprobs]
            tokens = [x for c in chunks if c.logprobs for x in c.logprobs.tokens]
        else:
            lp = client.completions.create(**kwargs).choices[0].logprobs
            token_logprobs, tops, tokens = lp.token_logprobs, lp.top_logprobs, lp.tokens
        want = [e[t].logprob for e, t in zip(expected.logprobs, expected.token_ids)]
        # float32 logits of the same model; batches differ only in rounding
        assert token_logprobs == pytest.approx(want, abs=1e-4)
        assert "".join(tokens) == expected.text
        for chosen, top, entry in zip(token_logprobs, tops, expected.logprobs):
            # OpenAI's legacy format keys the top tokens by text: tokens that decode alike (a
            # partial UTF-8 byte shows as U+FFFD) share a key, so there can be fewer than k
            offline_top = sorted((e.logprob for e in entry.values() if e.rank <= k), reverse=True)
            assert 1 <= len(top) <= k and len(offline_top) == k
            assert all(min(abs(v - w) for w in offline_top) < 1e-4 for v in top.values())
            assert max(top.values()) == pytest.approx(chosen, abs=1e-6)   # greedy: the argmax


# ---- chat -------------------------------------------------------------------------------------
def chat_prompt_ids(checkpoint, messages) -> list[int]:
    """The prompt as transformers renders the same template and encodes it."""
    import transformers

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"),
                                               bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<s>") and not text.startswith("<s><s>")
    return tok.encode(text, add_special_tokens=False)


def test_chat_renders_the_template_as_transformers_does(server, llm, checkpoint):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": [{"type": "text", "text": "def fib"},
                                             {"type": "text", "text": "onacci(n):"}]}]
    as_text = [messages[0], {"role": "user", "content": "def fib\nonacci(n):"}]
    ids = chat_prompt_ids(checkpoint, as_text)
    want = offline(llm, [ids], max_tokens=12, **GREEDY)[0]
    client = server.client()
    resp = client.chat.completions.create(model="tiny", messages=messages,
                                          max_completion_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want.text
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True, n=2,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert all(c.delta.role is None for c in mine[1:])
        assert "".join(c.delta.content or "" for c in mine) == want.text
        assert [c.finish_reason for c in mine][-1] == "length"
        assert all(c.finish_reason is None for c in mine[:-1])


def test_chat_logprobs_and_template_errors(server, llm, checkpoint):
    messages = [{"role": "user", "content": "import os"}]
    want = offline(llm, [chat_prompt_ids(checkpoint, messages)], max_tokens=5, logprobs=2,
                   **GREEDY)[0]
    resp = server.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
               for c in content)
    assert "".join(c.token for c in content) == want.text
    # the template's raise_exception is the user's error: a 400 naming messages
    bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": bad}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "system message must come first" in r.json()["error"]["message"]


TEMPLATES = {
    # block tags on lines of their own, indented: trim_blocks and lstrip_blocks matter
    "chatml": """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are helpful.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}""",
    "namespace-tojson-loopcontrols": (
        "{%- set ns = namespace(system='') -%}{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- continue -%}"
        "{%- endif -%}[{{ m.role | upper }}] {{ m.content | tojson }}{% if not loop.last %}\n"
        "{% endif %}{%- endfor %}\n{{ ns.system | tojson }}{{ eos_token }}"
        "{% if add_generation_prompt %}{% generation %}[ASSISTANT]{% endgeneration %}{% endif %}"),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_templates_render_as_transformers_renders_them(checkpoint, name):
    import transformers

    from pagedspec.serve.chat import ChatRenderer
    from pagedspec.serve.protocol import ChatMessage

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"),
                                               bos_token="<s>", eos_token="</s>")
    tok.chat_template = TEMPLATES[name]
    rng = random.Random(name)
    messages = [{"role": "system", "content": "Answer <b>briefly</b> & \"exactly\"."}] + [
        {"role": role, "content": rng.choice(PROMPTS) + " é"}
        for role in ["user", "assistant", "user"]]
    renderer = ChatRenderer(TEMPLATES[name], tok.backend_tokenizer, "<s>", "</s>")
    for add in (True, False):
        want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        mine = renderer.render([ChatMessage(**m) for m in messages], add)
        assert mine == want
        assert renderer.encode([ChatMessage(**m) for m in messages], add) == tok.encode(
            want, add_special_tokens=False)


def test_chat_without_a_template_is_a_clear_400(spec_server):
    r = httpx.post(spec_server.base_url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}]}, timeout=TIMEOUT)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and "no chat template" in error["message"]


# ---- disconnects ------------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks_and_spares_others(server, llm):
    server.wait_idle()
    core = server.engine.engine.core
    bm = core.block_manager
    idle_free = bm.num_free_blocks
    assert idle_free == bm.num_blocks
    long_tokens = MAX_MODEL_LEN - 40
    survivor_prompt, victim_prompt = PROMPTS[0], PROMPTS[3]
    want = offline(llm, [survivor_prompt], max_tokens=long_tokens, **GREEDY)[0]
    body = dict(model="tiny", max_tokens=long_tokens, temperature=0, ignore_eos=True,
                stream=True)
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", server.base_url + "/v1/completions",
                         json={**body, "prompt": survivor_prompt}) as survivor:
            lines = survivor.iter_lines()
            first = json.loads(next(line for line in lines if line)[len("data: "):])
            survivor_id = first["id"]
            survivor_text = first["choices"][0]["text"]
            with http.stream("POST", server.base_url + "/v1/completions",
                             json={**body, "prompt": victim_prompt}) as victim:
                victim_lines = victim.iter_lines()
                victim_id = json.loads(next(line for line in victim_lines
                                            if line)[len("data: "):])["id"]
                assert victim_id in core.requests
            # leaving the block closed the victim's connection: it must be gone within a few
            # steps, long before its hundreds of tokens, while the survivor still runs
            deadline = time.monotonic() + 10
            while victim_id in core.requests:
                assert time.monotonic() < deadline, "the disconnected request was not aborted"
                time.sleep(0.005)
            assert survivor_id in core.requests, "the survivor finished before the abort"
            survivor_seqs = {s.seq_id for s in core.requests[survivor_id].seqs}
            assert set(bm.tables) <= survivor_seqs      # no block table of the victim is left
            for line in lines:
                if line and line != "data: [DONE]":
                    survivor_text += json.loads(line[len("data: "):])["choices"][0]["text"]
    assert survivor_text == want.text
    server.wait_idle()
    assert bm.num_free_blocks == idle_free


def test_disconnect_while_waiting_for_a_non_streamed_answer(server):
    server.wait_idle()
    core = server.engine.engine.core
    before = server.metrics()

    async def go():
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            task = asyncio.ensure_future(http.post(
                server.base_url + "/v1/completions",
                json={"prompt": PROMPTS[4], "max_tokens": MAX_MODEL_LEN - 20, "temperature": 0,
                      "ignore_eos": True}))
            deadline = time.monotonic() + 10
            while not core.requests:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            (request_id,) = list(core.requests)
            task.cancel()       # the client gives up: httpx closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await task
            while request_id in core.requests:
                assert time.monotonic() < deadline, "the abandoned request was not aborted"
                await asyncio.sleep(0.005)
            return core.block_manager.num_free_blocks == core.block_manager.num_blocks

    assert asyncio.run(go())
    # it ended as an abort, not by running out its hundreds of tokens
    after = server.metrics()
    for reason, count in [("abort", 1), ("length", 0), ("stop", 0)]:
        assert server.counter(after, "request_success_total", finished_reason=reason) - \
            server.counter(before, "request_success_total", finished_reason=reason) == count


# ---- metrics ----------------------------------------------------------------------------------
def test_metrics_move_by_what_the_requests_did(server, llm):
    server.wait_idle()
    rng = random.Random(7)
    # fresh random token prompts: no prefix-cache hit, so every prompt token is computed
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    before = server.metrics()
    client = server.client()
    usage = [client.completions.create(model="tiny", prompt=p, max_tokens=4 + i, temperature=0,
                                       extra_body={"ignore_eos": True}).usage
             for i, p in enumerate(prompts)]
    stop_text = offline(llm, [prompts[0]], max_tokens=10, **GREEDY)[0].text
    stopped = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=10,
                                        temperature=0, stop=stop_text[3:6],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    server.wait_idle()
    after = server.metrics()

    def moved(name, **labels):
        return server.counter(after, name, **labels) - server.counter(before, name, **labels)

    assert moved("generation_tokens_total") == sum(u.completion_tokens for u in usage) + \
        stopped.usage.completion_tokens
    # the stopped request reuses prompts[0]'s cached blocks: only the part past them is computed
    assert sum(u.prompt_tokens for u in usage) <= moved("prompt_tokens_total") <= \
        sum(u.prompt_tokens for u in usage) + stopped.usage.prompt_tokens
    assert moved("request_success_total", finished_reason="length") == 3
    assert moved("request_success_total", finished_reason="stop") == 1
    assert moved("e2e_request_latency_seconds_count") == 4
    assert moved("time_to_first_token_seconds_count") == 4
    assert moved("inter_token_latency_seconds_count") == \
        moved("generation_tokens_total") - 4
    assert moved("request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usage) + \
        stopped.usage.prompt_tokens
    assert moved("request_generation_tokens_sum") == moved("generation_tokens_total")
    assert server.counter(after, "num_requests_running") == 0
    assert server.counter(after, "kv_cache_usage_perc") == 0


def test_spec_decode_metrics_and_lossless_greedy(spec_server, llm):
    before = spec_server.metrics()
    client = spec_server.client()
    prompt = PROMPTS[0] * 3
    want = offline(llm, [prompt], max_tokens=48, **GREEDY)[0]
    resp = client.completions.create(model="tiny-spec", prompt=prompt, max_tokens=48,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == want.text          # speculation never changes greedy text
    after = spec_server.metrics()

    def moved(name, **labels):
        return spec_server.counter(after, name, **labels) - \
            spec_server.counter(before, name, **labels)

    drafts, drafted = moved("spec_decode_num_drafts_total"), \
        moved("spec_decode_num_draft_tokens_total")
    accepted = moved("spec_decode_num_accepted_tokens_total")
    per_pos = [moved("spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
               for p in range(3)]
    assert drafts > 0 and 0 < accepted <= drafted <= 3 * drafts
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert moved("generation_tokens_total") == 48


# ---- bad requests -----------------------------------------------------------------------------
BAD_REQUESTS = [
    # (endpoint, body changes, status, param)
    ("completions", {"temperature": "hot"}, 400, "temperature"),
    ("completions", {"temperature": -1}, 400, "temperature"),
    ("completions", {"top_p": 2.0}, 400, "top_p"),
    ("completions", {"top_k": -5}, 400, "top_k"),
    ("completions", {"min_p": 1.5}, 400, "min_p"),
    ("completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("completions", {"n": 0}, 400, "n"),
    ("completions", {"n": 1000}, 400, "n"),
    ("completions", {"logprobs": 50}, 400, "logprobs"),
    ("completions", {"seed": "abc"}, 400, "seed"),
    ("completions", {"seed": 2 ** 70}, 400, "seed"),
    ("completions", {"stop": [""]}, 400, "stop"),
    ("completions", {"stop": 5}, 400, "stop"),
    ("completions", {"stop_token_ids": [10 ** 6]}, 400, "stop_token_ids"),
    ("completions", {"max_token": 5}, 400, "max_token"),
    ("completions", {"echo": True}, 400, "echo"),
    ("completions", {"suffix": "x"}, 400, "suffix"),
    ("completions", {"best_of": 3}, 400, "best_of"),
    ("completions", {"presence_penalty": 0.5}, 400, "presence_penalty"),
    ("completions", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"prompt": "word " * MAX_MODEL_LEN}, 400, "prompt"),
    ("completions", {"prompt": [10 ** 6, 5]}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": None}, 400, "prompt"),
    ("completions", {"model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content"),
    ("chat/completions", {"top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    ("chat/completions", {"max_completion_tokens": MAX_MODEL_LEN}, 400, "max_completion_tokens"),
    ("chat/completions", {"tools": [{"type": "function"}]}, 400, "tools"),
    ("chat/completions", {"model": "nope"}, 404, "model"),
]


def _base(endpoint: str) -> dict:
    if endpoint == "completions":
        return {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4}
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_bad_requests_get_their_status_and_spare_a_concurrent_request(server, llm):
    want = offline(llm, [PROMPTS[5]], max_tokens=60, **GREEDY)[0]

    async def go():
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            good = asyncio.ensure_future(http.post(server.base_url + "/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS[5], "max_tokens": 60, "temperature": 0,
                "ignore_eos": True}))
            bad = await asyncio.gather(*[
                http.post(f"{server.base_url}/v1/{endpoint}", json={**_base(endpoint), **change})
                for endpoint, change, _, _ in BAD_REQUESTS])
            raw = await asyncio.gather(
                http.post(server.base_url + "/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"}),
                http.post(server.base_url + "/v1/completions", json=[1, 2]),
                http.get(server.base_url + "/v1/nothing-here"))
            return (await good), bad, raw

    good, bad, raw = asyncio.run(go())
    for (endpoint, change, status, param), r in zip(BAD_REQUESTS, bad):
        assert r.status_code == status, (endpoint, change, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (change, error)
        assert param.split("[")[0] in error["message"], (change, error)
        assert error["type"] and "code" in error
    assert [r.status_code for r in raw] == [400, 400, 404]
    assert all("error" in r.json() for r in raw)
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == want.text
    # and the server still serves
    again = server.client().completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=60,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == want.text


def test_neutral_values_of_unimplemented_fields_are_accepted(server):
    r = httpx.post(server.base_url + "/v1/completions", timeout=TIMEOUT, json={
        **_base("completions"), "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0,
        "best_of": 1, "logit_bias": {}, "user": "someone", "top_k": 0})
    assert r.status_code == 200, r.text


def test_flood_beyond_max_waiting_gets_503s_and_nothing_else_breaks(checkpoint, llm):
    """Two sequences at a time and at most two waiting: of a burst of twelve, those beyond get
    503 at once while the running streams and the accepted requests complete unchanged."""
    long_tokens, short_tokens = 80, 6
    want_long = [offline(llm, [p], max_tokens=long_tokens, **GREEDY)[0].text for p in PROMPTS[:2]]
    want_short = offline(llm, PROMPTS, max_tokens=short_tokens, **GREEDY)
    config = engine_config(checkpoint, max_num_seqs=2)
    with running_server(config, "tiny", max_waiting=2) as srv:
        async def go():
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                async def stream(prompt):
                    text = ""
                    async with http.stream("POST", srv.base_url + "/v1/completions", json={
                            "prompt": prompt, "max_tokens": long_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                text += json.loads(line[6:])["choices"][0]["text"]
                                started.set()
                    return text

                started = asyncio.Event()
                longs = [asyncio.ensure_future(stream(p)) for p in PROMPTS[:2]]
                await asyncio.wait_for(started.wait(), TIMEOUT)
                burst = await asyncio.gather(*[http.post(srv.base_url + "/v1/completions", json={
                    "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": short_tokens,
                    "temperature": 0, "ignore_eos": True}) for i in range(12)])
                return await asyncio.gather(*longs), burst

        long_texts, burst = asyncio.run(go())
        assert long_texts == want_long
        statuses = [r.status_code for r in burst]
        # two may wait; one of them can be refused when it arrives in the instant between the
        # driver publishing a step's queue sizes and retiring its applied adds (counted twice)
        assert set(statuses) <= {200, 503} and 1 <= statuses.count(200) <= 2, statuses
        for i, r in enumerate(burst):
            if r.status_code == 200:
                assert r.json()["choices"][0]["text"] == want_short[i % len(PROMPTS)].text
            else:
                assert "max-waiting" in r.json()["error"]["message"]
        # after the flood the server serves as before
        ok = srv.client().completions.create(model="tiny", prompt=PROMPTS[3],
                                             max_tokens=short_tokens, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert ok.choices[0].text == want_short[3].text
        srv.wait_idle()
        bm = srv.engine.engine.core.block_manager
        assert bm.num_free_blocks == bm.num_blocks


# the driver thread re-raises the failure that stopped it, as it should
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_engine_that_dies_answers_500_and_health_503(checkpoint):
    """A failure inside a step (not a user's input) ends the engine: the open stream gets an
    error event and [DONE], later requests a 500 saying so, and /health turns 503."""
    with running_server(engine_config(checkpoint), "tiny") as srv:
        core_engine = srv.engine.engine
        real_step, calls = core_engine.step, []

        def failing_step():
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("injected step failure")
            return real_step()

        core_engine.step = failing_step
        with httpx.Client(timeout=TIMEOUT) as http:
            with http.stream("POST", srv.base_url + "/v1/completions", json={
                    "prompt": PROMPTS[0], "max_tokens": 50, "stream": True}) as r:
                events = [line for line in r.iter_lines() if line]
            assert r.status_code == 200 and events[-1] == "data: [DONE]"
            error = json.loads(events[-2][len("data: "):])["error"]
            assert "injected step failure" in error["message"]
            later = http.post(srv.base_url + "/v1/completions", json={"prompt": "x"})
            assert later.status_code == 500 and "engine stopped" in later.json()["error"]["message"]
            assert http.get(srv.base_url + "/health").status_code == 503
