"""The real ``openai`` SDK against a local cluster started with ``--openai-port``, as a user types it.

What a researcher checks: ``up`` prints the base_url and where the key is, ``status`` says it; the
SDK lists their jobs and chats with a running job's policy and with a finished one's, the samples
coming from that job's published adapter (its log-probs are not the base model's), at any kept
version (``JOB@VERSION``); streaming gives the same text, token by token; a bad request is a 400
naming the field; another user's key sees none of it.
"""

from __future__ import annotations

import getpass
import json
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, Cluster

openai = pytest.importorskip("openai")

from plexctl.tinker import keys  # noqa: E402

ASK = [{"role": "user", "content": "3+4="}]
GREEDY = {"temperature": 0.0, "max_tokens": 3, "seed": 1}
IDLE_S = 15  # a user's sampler job ends after this long without a request


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("openai"))
    up = c.run(
        "up", "--local", "--model", str(tiny_model), "--openai-port", "0", "--openai-idle", str(IDLE_S), timeout=900
    )
    assert up.returncode == 0, up.stdout + up.stderr
    c.up_output = up.stdout.replace("\n", "")  # rich wraps long lines at the terminal's width
    try:
        yield c
    finally:
        c.run("down", timeout=300)


def client(c: Cluster, key: str | None = None):
    url = json.loads((c.state_dir / "tinker.json").read_text())["openai_url"]
    return openai.OpenAI(base_url=url, api_key=key or (c.home / "tinker-api-key").read_text().strip(), max_retries=0)


def test_up_prints_where_the_api_is_and_status_says_it(cluster: Cluster):
    url = json.loads((cluster.state_dir / "tinker.json").read_text())["openai_url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    assert f"OpenAI API: base_url={url}, api_key in {cluster.home / 'tinker-api-key'}" in cluster.up_output
    assert cluster.status()["openai_url"] == url
    assert f"OpenAI API: base_url={url}" in cluster.run("status", check=True).stdout.replace("\n", "")
    assert "Tinker API" not in cluster.run("status", check=True).stdout  # not asked for


def test_a_jobs_policy_is_chatted_with_while_it_runs_and_after_it_ends(cluster: Cluster):
    job = cluster.run(
        "submit", str(REPO / "configs" / "tiny-arith.yaml"), "--set", "algo.steps=4", "-q", check=True
    ).stdout.strip()
    name = cluster.job(job)["name"]
    running = cluster.wait_for(job, lambda j: j["policy_version"] >= 1, timeout=600, what="a published policy")
    api = client(cluster)
    if running["state"] == "running":  # its latest published policy, while it trains
        out = api.chat.completions.create(model=job, messages=ASK, **GREEDY)
        assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason in ("stop", "length")
    assert cluster.run("wait", job, "--timeout", "600").returncode == 0
    last = cluster.job(job)["policy_version"]
    listed = {m.id for m in api.models.list().data}
    assert {job, name, "tiny-arith", "base:tiny-arith"} <= listed  # the job's name is the base's: the job comes first

    chat = api.chat.completions.create(model=name, messages=ASK, logprobs=True, **GREEDY)
    choice = chat.choices[0]
    assert chat.model == name and chat.usage.completion_tokens == len(choice.logprobs.content) >= 1
    assert "".join(t.token for t in choice.logprobs.content).startswith(choice.message.content)  # and <eos>
    same = api.chat.completions.create(model=f"{job}@{last}", messages=ASK, logprobs=True, **GREEDY)
    assert [t.logprob for t in same.choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in choice.logprobs.content], abs=1e-4
    )
    base = api.chat.completions.create(model=f"{job}@0", messages=ASK, logprobs=True, **GREEDY)
    base_too = api.chat.completions.create(model="base:tiny-arith", messages=ASK, logprobs=True, **GREEDY)
    assert base.choices[0].message.content == base_too.choices[0].message.content
    lp = [t.logprob for t in choice.logprobs.content]
    lp_base = [t.logprob for t in base.choices[0].logprobs.content]
    assert lp != pytest.approx(lp_base, abs=1e-6)  # the job's adapter, not the base, sampled it

    streamed = api.chat.completions.create(model=name, messages=ASK, stream=True, **GREEDY)
    assert "".join(part.choices[0].delta.content or "" for part in streamed) == choice.message.content
    # the likeliest tokens at each position: greedy, the sampled one is the first of them
    top = api.chat.completions.create(model=name, messages=ASK, logprobs=True, top_logprobs=3, **GREEDY)
    for position in top.choices[0].logprobs.content:
        values = [t.logprob for t in position.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert position.top_logprobs[0].token == position.token
        assert values[0] == pytest.approx(position.logprob, abs=1e-4)
    top_text = api.completions.create(model=name, prompt="3+4=", logprobs=2, **GREEDY).choices[0].logprobs
    assert [len(row) for row in top_text.top_logprobs] == [2] * len(top_text.tokens)
    assert [max(row.values()) for row in top_text.top_logprobs] == pytest.approx(top_text.token_logprobs, abs=1e-4)
    text = api.completions.create(model=name, prompt="3+4=", logprobs=0, **GREEDY)
    assert text.choices[0].text == choice.message.content  # no chat template: the message's text is the prompt
    assert text.choices[0].logprobs.token_logprobs == pytest.approx(lp, abs=1e-4)
    four = api.chat.completions.create(model=name, messages=ASK, n=4, temperature=1.0, max_tokens=3)
    assert len(four.choices) == 4 and sorted(c.index for c in four.choices) == [0, 1, 2, 3]
    # the requests are the scheduler's interactive class: `top` shows its share of engine time
    frame = json.loads(cluster.run("top", "--json", check=True).stdout)
    assert frame["interactive_share"] > 0 and frame["interactive_queued"] == 0
    assert "interactive " in cluster.run("top", check=True).stdout


IGNORE_EOS = {"extra_body": {"ignore_eos": True}}


def test_a_streamed_answer_comes_as_its_tokens_are_sampled(cluster: Cluster):
    """``stream=True``: a choice of plain text comes a piece per sampled token (here a digit
    each, the engine's steps), the pieces the text of the same request unstreamed, then its
    finish reason; several choices come so side by side, and log-probs with their tokens."""
    api = client(cluster)
    sum_of = {"model": "base:tiny-arith", "max_tokens": 6, "temperature": 0.0, **IGNORE_EOS}
    whole = api.completions.create(prompt="58+67=", **sum_of).choices[0].text
    parts = [p.choices[0] for p in api.completions.create(prompt="58+67=", stream=True, **sum_of)]
    pieces = [p.text for p in parts if p.text]
    assert len(whole) >= 2 and pieces == list(whole)  # a digit a token, each as it came
    assert parts[-1].finish_reason == "length" and all(p.finish_reason is None for p in parts[:-1])

    asked = [{"role": "user", "content": "58+67="}]
    message = api.chat.completions.create(messages=asked, **sum_of).choices[0].message.content
    chunks = [c.choices[0] for c in api.chat.completions.create(messages=asked, stream=True, **sum_of)]
    assert chunks[0].delta.role == "assistant" and chunks[-1].finish_reason == "length"
    assert [c.delta.content for c in chunks if c.delta.content] == list(message)

    # several choices come side by side, each a piece per token, each the choice of the same request unstreamed
    several = {"model": "base:tiny-arith", "prompt": "58+67=", "n": 2, "max_tokens": 4, "seed": 5, **IGNORE_EOS}
    alone = [c.text for c in api.completions.create(**several).choices]
    parts = [p.choices[0] for p in api.completions.create(stream=True, **several)]
    for i, text in enumerate(alone):
        pieces = [p.text for p in parts if p.index == i and p.text]
        assert "".join(pieces) == text and len(pieces) >= 2, (i, pieces, text)
        assert [p.finish_reason for p in parts if p.index == i][-1] == "length"

    # with log-probs each piece carries its tokens': together, those of the answer unstreamed
    scored = {**sum_of, "logprobs": 2}
    whole = api.completions.create(prompt="58+67=", **scored).choices[0].logprobs
    parts = [p.choices[0] for p in api.completions.create(prompt="58+67=", stream=True, **scored)]
    runs = [p.logprobs for p in parts if p.logprobs is not None]
    assert len(runs) >= 2 and [t for r in runs for t in r.tokens] == whole.tokens
    assert [v for r in runs for v in r.token_logprobs] == pytest.approx(whole.token_logprobs, abs=1e-4)
    assert [o for r in runs for o in r.text_offset] == whole.text_offset
    assert [list(t) for r in runs for t in r.top_logprobs] == [list(t) for t in whole.top_logprobs]
    chat = {**sum_of, "messages": asked, "logprobs": True, "top_logprobs": 2}
    whole = api.chat.completions.create(**chat).choices[0].logprobs.content
    chunks = [c.choices[0] for c in api.chat.completions.create(stream=True, **chat)]
    streamed = [t for c in chunks if c.logprobs is not None for t in c.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in whole] and len(streamed) >= 2
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole], abs=1e-4)
    assert [[x.token for x in t.top_logprobs] for t in streamed] == [[x.token for x in t.top_logprobs] for t in whole]


def test_bad_requests_name_the_field_and_other_users_see_nothing(cluster: Cluster):
    api = client(cluster)
    with pytest.raises(openai.NotFoundError, match="no model 'nope' of yours"):
        api.chat.completions.create(model="nope", messages=ASK)
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="tiny-arith", messages=ASK, max_tokens=100_000)
    assert refused.value.body["param"] == "max_tokens" and "context" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="tiny-arith", messages=ASK, temperature=7.0)
    assert refused.value.body["param"] == "temperature"
    for asked in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):  # without logprobs; past 20
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model="tiny-arith", messages=ASK, max_tokens=2, **asked)
        assert refused.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.AuthenticationError):
        client(cluster, "tml-" + "0" * 48).models.list()

    other = keys.PREFIX + secrets.token_hex(24)
    keys.register(cluster.state_dir, "mallory", keys.digest(other))
    theirs = client(cluster, other)
    assert {m.id for m in theirs.models.list().data} == {"tiny-arith", "base:tiny-arith"}  # no job of the owner's
    owners = [j for j in cluster.status()["jobs"] if j["policy_version"] > 0]
    assert owners, "the owner's job of the test before has a published policy"
    for job in owners:
        with pytest.raises(openai.NotFoundError):
            theirs.chat.completions.create(model=job["job_id"], messages=ASK, max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            theirs.chat.completions.create(model=f"{job['job_id']}@1", messages=ASK, max_tokens=2)
    # the owner's job is named as the base model is: to another user that name is the base's
    asked = theirs.chat.completions.create(model=owners[0]["name"], messages=ASK, logprobs=True, **GREEDY)
    base = api.chat.completions.create(model="base:tiny-arith", messages=ASK, logprobs=True, **GREEDY)
    assert [t.logprob for t in asked.choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in base.choices[0].logprobs.content], abs=1e-4
    )


def test_a_batch_of_prompts_answers_each_as_it_would_alone(cluster: Cluster, tiny_model: Path):
    """``prompt`` as a list of texts or of token-id lists (what lm-eval-harness sends): a choice
    per prompt and per ``n``, at index ``prompt * n + j``, each the answer the prompt gets alone."""
    from transformers import AutoTokenizer

    api = client(cluster)
    texts = ["3+4=", "2+5=", "1+1="]
    alone = [api.completions.create(model="base:tiny-arith", prompt=t, logprobs=0, **GREEDY) for t in texts]
    ids = [AutoTokenizer.from_pretrained(tiny_model)(t)["input_ids"] for t in texts]
    for batch in (texts, ids):
        out = api.completions.create(model="base:tiny-arith", prompt=batch, logprobs=0, **GREEDY)
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert [c.text for c in out.choices] == [a.choices[0].text for a in alone]
        for c, a in zip(out.choices, alone):
            assert c.logprobs.token_logprobs == pytest.approx(a.choices[0].logprobs.token_logprobs, abs=1e-4)
        assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) == sum(map(len, ids))
        assert out.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    two = api.completions.create(model="base:tiny-arith", prompt=texts[:2], n=2, temperature=1.0, max_tokens=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    streamed = api.completions.create(model="base:tiny-arith", prompt=texts, stream=True, **GREEDY)
    pieces: dict[int, str] = {}
    for part in streamed:
        for c in part.choices:
            pieces[c.index] = pieces.get(c.index, "") + c.text
    assert pieces == {i: a.choices[0].text for i, a in enumerate(alone)}
    # echo: the prompt, then the sampled text; its tokens' log-probs, then the sampled ones' (None
    # first): the sampled answer's, echoed in the prompt, are what sampling it gave
    echoed = api.completions.create(model="base:tiny-arith", prompt=texts, echo=True, logprobs=1, **GREEDY)
    for c, a, t in zip(echoed.choices, alone, texts):
        head = a.choices[0]
        assert c.text == t + head.text
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and lp.tokens[-len(head.logprobs.tokens) :] == head.logprobs.tokens
        assert lp.token_logprobs[-len(head.logprobs.tokens) :] == pytest.approx(head.logprobs.token_logprobs, abs=1e-4)
        assert len(lp.top_logprobs) == len(lp.tokens) and all(len(row) == 1 for row in lp.top_logprobs[1:])
        rescored = (
            api.completions.create(
                model="base:tiny-arith", prompt=t + head.text, echo=True, logprobs=0, max_tokens=1, temperature=0.0
            )
            .choices[0]
            .logprobs
        )
        n = len(head.logprobs.tokens) - (head.finish_reason == "stop")  # its <eos> is not in the text
        assert rescored.token_logprobs[-1 - n : -1] == pytest.approx(head.logprobs.token_logprobs[:n], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as refused:  # a prompt's length is the model's context's to bound
        api.completions.create(model="base:tiny-arith", prompt=ids[0] * 40, max_tokens=1)
    assert refused.value.body["param"] == "prompt" and "the model's context is" in refused.value.body["message"]
    for bad in ([1, "2"], [[1], "2"], [[]], [["a"]]):
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model="base:tiny-arith", prompt=bad, max_tokens=1)
        assert refused.value.body["param"] == "prompt", bad
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model="base:tiny-arith", prompt=texts * 6, n=4, max_tokens=1)
    assert refused.value.body["param"] == "prompt" and "over 64 choices" in refused.value.body["message"]


def test_the_docs_python_example_runs_as_written(cluster: Cluster, tmp_path: Path):
    """docs/openai.md's Python block, its port and key file those of this cluster."""
    page = (REPO / "docs" / "openai.md").read_text()
    [snippet] = re.findall(r"```python\n(.*?)```", page, re.S)
    url = json.loads((cluster.state_dir / "tinker.json").read_text())["openai_url"]
    assert 'base_url="http://127.0.0.1:8001/v1"' in snippet and "--openai-port 8001" in page
    script = tmp_path / "example.py"
    script.write_text(
        snippet.replace("http://127.0.0.1:8001/v1", url).replace(
            'os.path.expanduser("~/.plexrl/tinker-api-key")', repr(str(cluster.home / "tinker-api-key"))
        )
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    listed, answer = run.stdout.strip().splitlines()
    assert "'tiny-arith'" in listed and "'base:tiny-arith'" in listed
    text, logprobs = answer.split(" ", 1)
    assert text.isdigit() and len(json.loads(logprobs)) >= 1, answer


def test_lm_eval_harness_scores_a_trained_policy_as_the_docs_type_it(cluster: Cluster, tmp_path: Path):
    """docs/openai.md's lm_eval command, run as typed from the repository (its port, key file,
    job and output folder this cluster's): lm-eval-harness's ``local-completions`` model scores
    the job's policy on the tiny task, and its exact match is the one the SDK's own greedy answers
    to the same prompts give."""
    lm_eval = Path(sys.executable).parent / "lm_eval"
    if not lm_eval.exists():
        pytest.skip("lm_eval is not installed (pip install 'lm_eval[api]'; `make test` installs it)")
    page = (REPO / "docs" / "openai.md").read_text()
    command = next(b for b in re.findall(r"```bash\n(.*?)```", page, re.S) if "lm_eval " in b)
    trained = [j for j in cluster.status()["jobs"] if j["policy_version"] > 0 and j["state"] == "succeeded"]
    job = trained[0]["job_id"] if trained else "base:tiny-arith"
    url = json.loads((cluster.state_dir / "tinker.json").read_text())["openai_url"]
    typed = (
        command.replace("~/.plexrl/tinker-api-key", str(cluster.home / "tinker-api-key"))
        .replace("http://127.0.0.1:8001/v1", url)
        .replace("model=j0001", f"model={job}")
        .replace("--output_path lm-eval-out", f"--output_path {tmp_path / 'out'}")
        .replace("lm_eval --model", f"{lm_eval} --model")
    )
    env = {**cluster.env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run(["bash", "-c", typed], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    prompts = [json.loads(line) for line in (REPO / ".plexrl" / "data" / "arith" / "eval.jsonl").open()][:20]
    api = client(cluster)
    out = api.completions.create(
        model=job, prompt=[p["prompt"] for p in prompts], temperature=0.0, max_tokens=3, stop=["\n"]
    )
    hits = [c.text == p["answer"] for c, p in zip(out.choices, prompts)]
    assert results["tiny_arith"]["exact_match,none"] == pytest.approx(sum(hits) / len(hits)), results
    # by log-likelihood: the answer the job's policy scores highest of the 19, its log-probs the
    # prompt's echoed with each answer after it
    right = 0
    for p in prompts:
        scored = api.completions.create(
            model=job, prompt=[p["prompt"] + str(a) for a in range(19)], echo=True, logprobs=0, max_tokens=1
        )
        assert all(c.logprobs.token_logprobs[0] is None for c in scored.choices)  # <bos>: nothing before it
        sums = [  # the answer's tokens (a digit each), before the one token sampled after them
            sum(c.logprobs.token_logprobs[len(c.logprobs.tokens) - 1 - len(str(a)) : -1])
            for a, c in zip(range(19), scored.choices)
        ]
        right += max(range(19), key=sums.__getitem__) == int(p["answer"])
    assert results["tiny_arith_choice"]["acc,none"] == pytest.approx(right / len(prompts)), results
    print(f"lm-eval on {job}: exact_match {sum(hits) / len(hits):.2f}, acc {right / len(prompts):.2f}")


def test_a_killed_front_end_comes_back_at_the_same_base_url_and_status_says_so_meanwhile(cluster: Cluster):
    """SIGKILL to the front end: every status meanwhile says the OpenAI API is restarting (and
    nothing of a Tinker API it does not serve); it comes back at the base_url it had."""
    import os
    import signal
    import time

    ready = cluster.state_dir / "tinker.json"
    before = json.loads(ready.read_text())
    os.kill(before["pid"], signal.SIGKILL)
    notes, deadline = [], time.monotonic() + 90
    while time.monotonic() < deadline:
        shown = cluster.status()
        assert "tinker_url" not in shown and "tinker_note" not in shown, shown
        if shown.get("openai_url") and json.loads(ready.read_text()).get("pid") != before["pid"]:
            break
        if shown.get("openai_url") is None:
            notes.append(shown.get("openai_note", ""))
    assert notes and all(n.startswith("restarting") for n in notes), notes
    assert shown["openai_url"] == before["openai_url"]
    reply = client(cluster).chat.completions.create(model="base:tiny-arith", messages=ASK, **GREEDY)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_an_idle_users_sampler_job_ends_and_their_next_request_starts_one(cluster: Cluster):
    api = client(cluster)

    def samplers(state: str) -> list[str]:
        return [
            j["job_id"]
            for j in cluster.status()["jobs"]
            if j["name"].startswith("tinker-sample-") and j["state"] == state and j["user"] == getpass.getuser()
        ]

    api.chat.completions.create(model="base:tiny-arith", messages=ASK, max_tokens=2)
    [serving] = samplers("running")
    deadline = time.monotonic() + IDLE_S + 60
    while cluster.job(serving)["state"] == "running":  # no request for IDLE_S: it ends, as if its client closed it
        assert time.monotonic() < deadline, cluster.job(serving)
        time.sleep(1.0)
    assert cluster.job(serving)["state"] == "succeeded"
    assert "idle for 15 s: ended" in (cluster.state_dir / "tinker.log").read_text()
    again = api.chat.completions.create(model="base:tiny-arith", messages=ASK, max_tokens=2)
    assert again.choices[0].finish_reason in ("stop", "length")
    assert len(samplers("running")) == 1 and samplers("running") != [serving]


# ---------------------------------------------------------------- tools

ADD = {
    "type": "function",
    "function": {"name": "add", "description": "a + b", "parameters": {"type": "object", "properties": {}}},
}
TOOLS_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %};{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %} call {{ c.function.name }} a={{ c.function.arguments.a }};{% endfor %}"
    "{% endfor %}assistant:"
)


def test_tool_calls_are_read_from_the_sampled_text_as_the_sdk_types_them():
    from openai.types.chat import ChatCompletion

    from plexctl.common.calls import Completion
    from plexctl.tinker.openai_api import Policy, chat_answer, tool_calls_of

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    text = f"let me add {call}<tool_call>{{bad}}</tool_call>"
    content, calls = tool_calls_of(text)
    assert content == "let me add" and [c["function"]["name"] for c in calls] == ["add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 3, "b": 4} and calls[0]["id"].startswith("call_")
    assert tool_calls_of("3+4=7") == ("3+4=7", [])
    done = [Completion(0, text, [1, 2], [3], [-0.5], "stop"), Completion(0, "7", [1, 2], [4], [-0.1], "stop")]
    answer = ChatCompletion.model_validate(chat_answer(Policy("m", "", 64), done, False, "chatcmpl-1", tools=True))
    called, plain = answer.choices
    assert called.finish_reason == "tool_calls" and called.message.tool_calls[0].function.name == "add"
    assert plain.finish_reason == "stop" and plain.message.content == "7" and not plain.message.tool_calls


def test_tools_reach_a_chat_template_that_renders_them_and_a_model_without_one_refuses_them(tmp_path: Path):
    from plexctl.tinker.openai_api import (
        ApiRefusal,
        CalledFunction,
        ChatMessage,
        Tool,
        ToolCall,
        chat_prompt,
        tokenizer,
    )

    plain_dir, tools_dir = tmp_path / "plain", tmp_path / "tools"
    for d in (plain_dir, tools_dir):
        d.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (d / name).write_bytes((REPO / ".plexrl" / "models" / "tiny-arith" / name).read_bytes())
    config = json.loads((tools_dir / "tokenizer_config.json").read_text())
    (tools_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    tools = [msgspec_convert(ADD, Tool)]
    asked = [
        ChatMessage("user", "what is 3+4?"),
        ChatMessage("assistant", "", tool_calls=[ToolCall("call_1", CalledFunction("add", '{"a": 3, "b": 4}'))]),
        ChatMessage("tool", "7", tool_call_id="call_1"),
    ]
    text = tokenizer(str(tools_dir)).decode(chat_prompt(str(tools_dir), asked, tools))
    assert text == "tools: add;user: what is 3+4?assistant:  call add a=3;tool: 7assistant:"
    with pytest.raises(ApiRefusal) as refused:
        chat_prompt(str(plain_dir), asked, tools)
    assert refused.value.param == "tools" and "no tools" in str(refused.value)


def msgspec_convert(value, kind):
    import msgspec

    return msgspec.convert(value, kind)


def test_a_model_without_tools_in_its_template_refuses_them_through_the_sdk(cluster: Cluster):
    api = client(cluster)
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="tiny-arith", messages=ASK, tools=[ADD], max_tokens=2)
    assert refused.value.body["param"] == "tools"
    # a forced call is JSON, held token by token: tiny-arith's characters have no "[" or "{" to write it with
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="tiny-arith", messages=ASK, tools=[ADD], tool_choice="required")
    assert refused.value.body["param"] == "tool_choice" and "cannot write JSON" in refused.value.body["message"]
    named = {"type": "function", "function": {"name": "mul"}}
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="tiny-arith", messages=ASK, tools=[ADD], tool_choice=named)
    assert refused.value.body["param"] == "tool_choice" and "'mul'" in refused.value.body["message"]
    # "none": the tools are not given to the model, so any model answers
    out = api.chat.completions.create(model="tiny-arith", messages=ASK, tools=[ADD], tool_choice="none", **GREEDY)
    assert out.choices[0].finish_reason in ("stop", "length") and not out.choices[0].message.tool_calls


def test_a_json_schema_response_format_holds_every_sample_to_it(cluster: Cluster):
    api = client(cluster)
    answer = {"type": "string", "enum": ["seven", "eight"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}}
    out = api.chat.completions.create(
        model="tiny-arith", messages=ASK, response_format=fmt, n=8, temperature=1.0, max_tokens=10, seed=2
    )
    said = [json.loads(c.message.content) for c in out.choices]
    assert set(said) <= {"seven", "eight"} and all(c.finish_reason == "stop" for c in out.choices)
    number = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    out = api.chat.completions.create(model="tiny-arith", messages=ASK, response_format=number, n=4, max_tokens=8)
    assert all(isinstance(json.loads(c.message.content), int) for c in out.choices if c.finish_reason == "stop")
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="tiny-arith", messages=ASK, response_format=bad, max_tokens=4)
    assert refused.value.body["param"] == "response_format" and "nonsense" in refused.value.body["message"]


@pytest.mark.parametrize(
    "choice",
    [{"type": "function", "function": "add"}, {"type": "function"}, {"type": "tool"}, "always"],
)
def test_a_malformed_tool_choice_is_a_400_naming_it(choice):
    import msgspec

    from plexctl.tinker.openai_api import ApiRefusal, ChatMessage, ChatReq, Tool, chat_structure

    tools = [msgspec.convert(ADD, Tool)]
    with pytest.raises(ApiRefusal) as refused:
        chat_structure(ChatReq(model="m", messages=[ChatMessage("user", "x")], tools=tools, tool_choice=choice))
    assert (refused.value.status, refused.value.param) == (400, "tool_choice")


def test_a_forced_call_is_json_of_the_tools_schemas_sampled_by_a_real_engine(tmp_path: Path):
    """tool_choice "required" and a named function, held by vLLM's structured decoding on a
    model whose characters can write JSON (tiny-arith's, with "<>()" read as "{}[]")."""
    import msgspec

    from plexctl.common.calls import GenRequest, Sampling
    from plexctl.tinker.openai_api import ChatMessage, ChatReq, Tool, chat_structure, read_structured
    from worker.rollout import RolloutEngine

    model = tmp_path / "json-chars"
    model.mkdir()
    for f in (REPO / ".plexrl" / "models" / "tiny-arith").iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    tok = json.loads((model / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for was, now in (("<", "{"), (">", "}"), ("(", "["), (")", "]")):
        vocab[now] = vocab.pop(was)
    (model / "tokenizer.json").write_text(json.dumps(tok))
    op = {"type": "string", "enum": ["x", "y"]}
    params = {"type": "object", "properties": {"op": op, "k": {"type": "integer"}}, "required": ["op", "k"]}
    tools = [
        msgspec.convert({"type": "function", "function": {"name": n, "parameters": params}}, Tool)
        for n in ("add", "mul")
    ]
    asked = [ChatMessage("user", "1+2=")]
    required = chat_structure(ChatReq(model="m", messages=asked, tools=tools, tool_choice="required"))[2]
    named = {"type": "function", "function": {"name": "mul"}}
    one = chat_structure(ChatReq(model="m", messages=asked, tools=tools, tool_choice=named))[2]
    engine = RolloutEngine(str(model), max_loras=1, max_cpu_loras=1, max_model_len=64)
    try:
        got = engine.generate(
            [
                GenRequest("x", ["1+2="], Sampling(max_tokens=60, n=8, seed=1, json_schema=how.schema))
                for how in (required, one)
            ]
        )
    finally:
        engine.close()
    for how, samples in zip((required, one), got, strict=True):
        ended = [c for c in samples if c.finish_reason == "stop"]  # the others ran out of the 64-token context
        assert ended and all(c.finish_reason == "length" for c in samples if c not in ended), samples
        for c in ended:
            content, calls = read_structured(c.text, how)
            assert content is None and calls
            for call in calls:
                assert call["function"]["name"] in (("mul",) if how.call else ("add", "mul"))
                arguments = json.loads(call["function"]["arguments"])
                assert arguments["op"] in ("x", "y") and isinstance(arguments["k"], int)
