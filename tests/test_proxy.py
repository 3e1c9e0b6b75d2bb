"""``kv-chunk-fs proxy`` against a fake llama-server (tests/fake_llama.py) that saves and restores its
slots in a real kv-chunk-fs mount: pass-through, routing, restore, save names, streaming, disconnects,
the budget and the metrics, driven with the real ``openai`` client where a client is involved."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from conftest import Mount
from fake_llama import FakeLlama, ServerThread
from prometheus_client.parser import text_string_to_metric_families

from kvchunkfs.proxy.cache import LABEL_XATTR
from kvchunkfs.proxy.mountcheck import check_mount
from kvchunkfs.proxy.server import Proxy

SYSTEM = "you are a careful agent " * 30  # shared by every conversation: ~150 tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Rig:
    mount: Mount
    fake: FakeLlama
    upstream: ServerThread
    proxy: Proxy
    server: ServerThread
    direct: FakeLlama  # a second fake talked to directly: the reference outputs

    @property
    def url(self) -> str:
        return self.server.url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def files(self) -> list[str]:
        return sorted(os.listdir(self.mount.mnt))

    def idle(self, timeout: float = 30) -> None:
        """Until every save has finished and every slot is free."""
        deadline = time.monotonic() + timeout
        while self.proxy._tasks or (self.proxy.pool and any(s.busy for s in self.proxy.pool.slots)):
            assert time.monotonic() < deadline, "proxy did not settle"
            time.sleep(0.02)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        return {f"{s.name}{sorted(s.labels.items())}": s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples}  # fmt: skip

    def restart_proxy(self, **kw: int) -> None:
        self.server.stop()
        self.proxy = Proxy(self.upstream.url, self.mount.mnt, self.mount.store, **{"min_restore": 4, **kw})
        self.server = ServerThread(self.proxy.app, free_port()).start()


def make_rig(tmp_path: Path, slots: int = 2, delay: float = 0.0, save_delay: float = 0.0, api_key: str = "",
             **kw: int) -> Iterator[Rig]:  # fmt: skip
    mount = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log")
    mount.start()
    servers: list[ServerThread] = []  # stopped however the setup or the test ends (no mount left behind)
    rig: Rig | None = None
    try:
        fake = FakeLlama(mount.mnt, slots, delay, save_delay, api_key)
        upstream = ServerThread(fake.app, free_port()).start()
        servers.append(upstream)
        (tmp_path / "direct").mkdir()
        proxy = Proxy(upstream.url, mount.mnt, mount.store, **{"min_restore": 4, **kw})
        rig = Rig(mount, fake, upstream, proxy, ServerThread(proxy.app, free_port()).start(),
                  FakeLlama(tmp_path / "direct", slots))  # fmt: skip
        yield rig
    finally:
        if rig is not None:
            rig.server.stop()  # the proxy serving now (restart_proxy replaces it)
        for server in servers:
            server.stop()
        mount.stop()
    assert "Traceback" not in mount.log(), mount.log()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from make_rig(tmp_path)


def direct_chat(rig: Rig, messages: list[dict]) -> str:
    """The reference answer: the same request straight to a fake llama-server."""
    direct = ServerThread(rig.direct.app, free_port()).start()
    try:
        client = openai.OpenAI(base_url=direct.url + "/v1", api_key="none", max_retries=0)
        out = client.chat.completions.create(model="fake", messages=messages, max_tokens=6)  # type: ignore[arg-type]
        return out.choices[0].message.content or ""
    finally:
        direct.stop()


def chat(rig: Rig, messages: list[dict], stream: bool = False) -> str:
    client = rig.client()
    if stream:
        parts = client.chat.completions.create(model="fake", messages=messages, max_tokens=6, stream=True)  # type: ignore[arg-type]
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    out = client.chat.completions.create(model="fake", messages=messages, max_tokens=6)  # type: ignore[arg-type]
    return out.choices[0].message.content or ""


def turn(rig: Rig, messages: list[dict], user: str, stream: bool = False) -> list[dict]:
    """Ask ``user`` after ``messages``; returns the conversation with the answer appended."""
    messages = [*messages, {"role": "user", "content": user}]
    answer = chat(rig, messages, stream)
    rig.idle()
    return [*messages, {"role": "assistant", "content": answer}]


def conversation(name: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM + name}]


# -- pass-through ----------------------------------------------------------------------------------


def test_passthrough_of_the_api_status_codes_and_errors(rig: Rig) -> None:
    for path in ("/health", "/props", "/models", "/v1/models", "/slots"):
        assert httpx.get(rig.url + path).json() == httpx.get(rig.upstream.url + path).json(), path
    assert [m.id for m in rig.client().models.list()] == ["fake"]
    r = httpx.get(rig.url + "/no-such-endpoint")
    assert r.status_code == 404
    bad = httpx.post(rig.url + "/completion", json={"n_predict": 2})  # no prompt: the upstream's 400
    assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]
    not_json = httpx.post(rig.url + "/completion", content=b"{nope")
    assert not_json.status_code >= 400
    with pytest.raises(openai.BadRequestError):
        rig.client().chat.completions.create(model="fake", messages="nope", max_tokens=2)  # type: ignore[arg-type]
    rig.idle()
    assert all(not s.busy for s in rig.proxy.pool.slots)  # type: ignore[union-attr]


def test_upstream_down_is_a_502_not_a_crash(tmp_path: Path) -> None:
    proxy = Proxy(f"http://127.0.0.1:{free_port()}", None, None)
    server = ServerThread(proxy.app, free_port()).start()
    try:
        for path in ("/health", "/v1/chat/completions"):
            r = httpx.post(server.url + path, json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/metrics").status_code == 200
    finally:
        server.stop()


def test_completion_endpoints_with_text_and_token_prompts(rig: Rig) -> None:
    prompt = SYSTEM + "tell me a story"
    a = httpx.post(rig.url + "/completion", json={"prompt": prompt, "n_predict": 5}, timeout=30).json()
    rig.idle()
    b = rig.client().completions.create(model="fake", prompt=prompt + " again", max_tokens=5)
    rig.idle()
    tokens = httpx.post(rig.upstream.url + "/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
    c = httpx.post(rig.url + "/completion", json={"prompt": tokens, "n_predict": 5, "stream": True}, timeout=30)
    rig.idle()
    assert a["content"] and b.choices[0].text
    events = [json.loads(line[6:]) for line in c.text.splitlines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events).strip() == a["content"]  # same prompt, same greedy output
    # The second and third requests reused the first one's prefix (slot or store), pinned to a slot.
    assert [r.id_slot is not None for r in rig.fake.records] == [True, True, True]
    assert rig.fake.records[1].cache_n >= len(tokens) - 1 and rig.fake.records[2].prompt_n == 1


# -- conversations -------------------------------------------------------------------------------


def test_a_conversation_replaces_its_snapshot_and_matches_direct_answers(rig: Rig) -> None:
    messages = conversation("A")
    for i in range(3):
        before = len(rig.fake.records)
        messages = turn(rig, messages, f"question {i} about the weather")
        assert messages[-1]["content"] == direct_chat(rig, messages[:-1])
        assert [f for f in rig.files() if f.startswith("kvp-")] == rig.files() and len(rig.files()) == 1, rig.files()
        if i:  # the slot held the previous turn: only the new tokens were evaluated
            record = rig.fake.records[before]
            assert record.cache_n > len(SYSTEM.split()) and record.prompt_n < 20, record
    name = rig.files()[0]
    assert int(os.getxattr(rig.mount.mnt / name, LABEL_XATTR)) > len(SYSTEM.split())
    saved_as = [a[2] for a in rig.fake.actions if a[0] == "save"]
    assert len(saved_as) == 3 and all(re.fullmatch(re.escape(name) + r"\.[0-9a-f]{12}\.tmp", t) for t in saved_as)
    assert len(set(saved_as)) == 3, "a temporary name of its own per save"


def test_the_next_turn_on_its_own_slot_asks_the_store_nothing(rig: Rig) -> None:
    asked: list[str] = []
    ask_daemon = rig.proxy._ask_daemon

    async def spy(method: str, path: str, **kw: object) -> httpx.Response:
        asked.append(path)
        return await ask_daemon(method, path, **kw)

    rig.proxy._ask_daemon = spy  # type: ignore[method-assign]
    messages = turn(rig, conversation("A"), "first")
    assert asked == ["/prefix-match"]  # a new conversation: is any of it stored?
    for i in range(3):
        messages = turn(rig, messages, f"turn {i}")
    assert asked == ["/prefix-match"], "the slot holds the conversation: no lookup"
    assert all(r.prompt_n < 20 for r in rig.fake.records[1:]), rig.fake.records
    assert len(rig.files()) == 1


def test_a_branch_keeps_both_and_other_conversations_reuse_the_system_prompt(rig: Rig) -> None:
    a1 = turn(rig, conversation("A"), "first question")
    a2 = turn(rig, a1, "second question")
    assert len(rig.files()) == 1
    turn(rig, a1, "a different second question")  # branch after turn 1
    assert len(rig.files()) == 2
    turn(rig, conversation("A")[:1], "first question, edited")  # edit of turn 1
    assert len(rig.files()) == 3
    turn(rig, a2, "third question")  # the first branch goes on: replaces its own file
    assert len(rig.files()) == 3


def test_more_conversations_than_slots_are_restored_from_the_store(rig: Rig) -> None:
    convs = {name: conversation(name) for name in "ABCDE"}
    for round_ in range(3):
        for name in convs:  # interleaved: 5 conversations over 2 slots
            convs[name] = turn(rig, convs[name], f"{name} round {round_}")
            assert convs[name][-1]["content"] == direct_chat(rig, convs[name][:-1])
    assert len(rig.files()) == 5
    restores = [a for a in rig.fake.actions if a[0] == "restore"]
    assert len(restores) >= 2 * 5 - 2  # every later turn finds its conversation in the store
    m = rig.metrics()
    assert m["kvcfs_proxy_prompt_tokens_total[('source', 'restored')]"] > 0
    assert m["kvcfs_proxy_requests_total[('outcome', 'restored')]"] >= 8
    assert 0 < m["kvcfs_proxy_prompt_hit_ratio[]"] <= 1


def test_restart_of_llama_server_mount_and_proxy_restores_from_the_store(rig: Rig) -> None:
    convs = {name: turn(rig, conversation(name), f"{name} hello") for name in "ABC"}
    rig.fake.restart()  # llama-server restarted: empty slots
    rig.mount.remount()
    # The proxy goes on across the remount (its pooled API connection is gone) ...
    convs["A"] = turn(rig, convs["A"], "A after the remount")
    assert rig.fake.actions[-2][0] == "restore" and rig.fake.records[-1].prompt_n < 20
    rig.fake.restart()
    rig.restart_proxy()  # ... and a new proxy finds everything in the store too
    shared = 0
    for name, messages in convs.items():
        before = len(rig.fake.records)
        convs[name] = turn(rig, messages, f"{name} again")
        record = rig.fake.records[before]
        shared += record.cache_n
        assert record.prompt_n < 20, record  # all but the new turn came from the store
        assert convs[name][-1]["content"] == direct_chat(rig, convs[name][:-1])
    assert len(rig.files()) == 3


def test_parallel_conversations_run_on_different_slots(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    for rig in make_rig(tmp_path, slots=2, delay=0.05):
        convs = [conversation(n) for n in "AB"]
        with ThreadPoolExecutor(2) as pool:
            asks = [[*m, {"role": "user", "content": "go"}] for m in convs]
            answers = list(pool.map(lambda m, rig=rig: chat(rig, m, stream=True), asks))
        rig.idle()
        assert all(answers)
        slots = {r.id_slot for r in rig.fake.records}
        assert slots == {0, 1}
        assert len(rig.files()) == 2


def saved_tokens(path: Path) -> list[int]:
    """The tokens in the header of a fake llama-server slot file."""
    data = path.read_bytes()
    n = struct.unpack_from("<3I", data)[2]
    return list(struct.unpack_from(f"<{n}i", data, 12))


def test_two_continuations_of_one_turn_at_once_each_keep_their_branch(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from fake_llama import template, tokenize

    for rig in make_rig(tmp_path, slots=2, delay=0.05, save_delay=0.2):
        a1 = turn(rig, conversation("A"), "first question")
        branches = [[*a1, {"role": "user", "content": f"second question, take {i}"}] for i in range(2)]
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda m, rig=rig: chat(rig, m, stream=True), branches))
        rig.idle()
        assert all(answers)
        assert rig.metrics().get("kvcfs_proxy_errors_total[('step', 'save')]", 0) == 0
        files = rig.files()
        assert len(files) == 2 and not [f for f in files if f.endswith(".tmp")], files
        held = [saved_tokens(rig.mount.mnt / f) for f in files]
        for branch in branches:  # each branch is in a file of its own, with the whole shared history
            prompt = tokenize(template(branch), True)
            assert sum(t[: len(prompt)] == prompt for t in held) == 1, branch[-1]
        # Both go on from their own snapshot.
        for branch, answer in zip(branches, answers, strict=True):
            turn(rig, [*branch, {"role": "assistant", "content": answer}], "third")
        assert len(rig.files()) == 2


def test_the_next_turn_right_away_waits_for_its_slot_to_finish_saving(tmp_path: Path) -> None:
    for rig in make_rig(tmp_path, slots=2, save_delay=0.3):
        messages = [*conversation("A"), {"role": "user", "content": "first"}]
        for i in range(3):  # no pause: each turn arrives while the previous one is being saved
            messages += [{"role": "assistant", "content": chat(rig, messages)}, {"role": "user", "content": f"q{i}"}]
        rig.idle()
        assert {r.id_slot for r in rig.fake.records} == {0}  # the other slot was free all along
        assert all(r.prompt_n < 20 for r in rig.fake.records[1:]), rig.fake.records
        assert not [a for a in rig.fake.actions if a[0] == "restore"]
        assert len(rig.files()) == 1


def test_an_upstream_api_key_is_used_for_the_proxys_own_calls(tmp_path: Path) -> None:
    for rig in make_rig(tmp_path, api_key="sekrit"):
        messages = [*conversation("K"), {"role": "user", "content": "hi"}]
        with pytest.raises(openai.AuthenticationError):  # the upstream's 401, passed through
            rig.client().chat.completions.create(model="fake", messages=messages, max_tokens=2)  # type: ignore[arg-type]
        client = openai.OpenAI(base_url=rig.url + "/v1", api_key="sekrit", max_retries=0)
        client.chat.completions.create(model="fake", messages=messages, max_tokens=2)  # type: ignore[arg-type]
        rig.idle()
        assert len(rig.files()) == 1 and rig.fake.records[-1].id_slot is not None
        rig.fake.restart()
        client.chat.completions.create(model="fake", messages=[*messages, {"role": "user", "content": "more"}],
                                       max_tokens=2)  # type: ignore[arg-type]  # fmt: skip
        rig.idle()
        assert [a[0] for a in rig.fake.actions] == ["save", "restore", "save"]
        assert not [r for r in rig.fake.records if r.id_slot is None]


def test_failed_restores_and_saves_cost_prefill_not_answers(rig: Rig) -> None:
    a1 = turn(rig, conversation("A"), "one")
    rig.fake.restart()
    rig.fake.fail_restores = True
    a2 = turn(rig, a1, "two")  # the restore fails: prefill instead, same answer
    assert a2[-1]["content"] == direct_chat(rig, a2[:-1])
    assert rig.fake.records[-1].cache_n <= 1  # the first token: the probe that checked the server's layout
    m = rig.metrics()
    assert m["kvcfs_proxy_refused_restores_total[('reason', 'refused')]"] == 1
    assert all(not s.busy for s in rig.proxy.pool.slots)  # type: ignore[union-attr]
    left = rig.files()
    rig.fake.save_fails = True  # llama-server cannot save (e.g. the disk is full) after writing part of it
    turn(rig, conversation("C"), "one")
    assert rig.metrics()["kvcfs_proxy_errors_total[('step', 'save')]"] == 1
    assert rig.files() == left  # C's partial NAME.tmp is removed


def test_no_save_lands_on_the_bare_mountpoint_and_mount_refuses_a_non_empty_one(rig: Rig) -> None:
    a1 = turn(rig, conversation("A"), "one")
    assert len(rig.files()) == 1
    rig.mount.stop()  # the daemon stops (a restart, a crash): the mountpoint is a plain directory again
    turn(rig, a1, "two")
    turn(rig, conversation("B"), "one")
    assert os.listdir(rig.mount.mnt) == [], "llama-server's full files on the disk under the mount"
    assert rig.metrics()["kvcfs_proxy_skipped_saves_total[('reason', 'not_mounted')]"] == 2
    assert rig.metrics().get("kvcfs_proxy_errors_total[('step', 'save')]", 0) == 0
    # A directory that is not a mount is refused however it looks; so is a subdirectory of one.
    rig.proxy.mount = rig.mount.mnt.parent / "direct"
    turn(rig, conversation("C"), "one")
    assert os.listdir(rig.mount.mnt.parent / "direct") == []
    assert rig.metrics()["kvcfs_proxy_skipped_saves_total[('reason', 'not_mounted')]"] == 3
    # kv-chunk-fs mount does not cover files it would hide, unless told to.
    (rig.mount.mnt / "left-behind").write_bytes(b"x")
    with pytest.raises(RuntimeError, match="is not empty"):
        rig.mount.start()
    rig.mount.start(["--nonempty"])
    (rig.mount.mnt / "sub").mkdir()
    rig.proxy.mount = rig.mount.mnt / "sub"
    rig.fake.slot_dir = rig.mount.mnt / "sub"
    turn(rig, a1, "two")
    assert len(os.listdir(rig.mount.mnt / "sub")) == 1  # saved again, on the mount
    rig.mount.stop()
    os.unlink(rig.mount.mnt / "left-behind")
    rig.mount.start()


def test_bodies_over_the_limit_and_malformed_json_are_4xx_never_500(tmp_path: Path) -> None:
    for rig in make_rig(tmp_path, max_body=256 * 1024):
        big = b'{"prompt": "' + b"x " * 200_000 + b'"}'
        assert httpx.post(rig.url + "/completion", content=big).status_code == 413
        chunked = httpx.post(rig.url + "/completion", content=iter([big[:1000], big[1000:]]))  # no Content-Length
        assert chunked.status_code == 413 and "proxy_max_body" in chunked.json()["error"]["message"]
        assert httpx.post(rig.url + "/tokenize", content=big).status_code == 413  # every path
        deep = 100_000
        bad = [b"{nope", b"[1, 2]", b'"text"', b"null", b"\xff\xfe{}",
               b'{"prompt": ' + b"[" * deep + b"]" * deep + b"}",
               b'{"messages": ' + b"[" * 70 + b"]" * 70 + b"}",
               b'{"prompt": "a", "x": ' + b'{"a":' * 65 + b"1" + b"}" * 65 + b"}"]  # fmt: skip
        for body in bad:
            for path in ("/completion", "/v1/chat/completions"):
                r = httpx.post(rig.url + path, content=body)
                assert r.status_code == 400 and r.json()["error"]["message"], (path, body[:30], r.text[:200])
        assert rig.fake.records == [], "nothing reached llama-server's generation"
        assert rig.metrics()["kvcfs_proxy_refused_requests_total[('status', '400')]"] == 2 * len(bad)
        code = "def f(x): return [[[[x]]]] " * 20  # brackets in a prompt are not nesting
        ok = httpx.post(rig.url + "/completion", json={"prompt": code, "n_predict": 2}, timeout=30)
        assert ok.status_code == 200, ok.text


def test_a_request_the_upstream_would_refuse_costs_the_proxy_one_small_request(tmp_path: Path) -> None:
    for rig in make_rig(tmp_path, api_key="sekrit"):
        good = {"Authorization": "Bearer sekrit"}
        messages = [*conversation("K"), {"role": "user", "content": "hi"}]
        first = httpx.post(rig.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2},
                           headers=good, timeout=30)  # fmt: skip
        assert first.status_code == 200
        rig.idle()
        huge = {"messages": [{"role": "user", "content": "word " * 2_000_000}], "max_tokens": 2}  # 10 MB
        for headers in ({"Authorization": "Bearer wrong"}, {}):
            rig.fake.calls.clear()
            r = httpx.post(rig.url + "/v1/chat/completions", json=huge, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["message"] == "Invalid API Key"
            assert rig.fake.calls == ["/props"], "no template, tokenize or generation for a refused key"
        rig.fake.calls.clear()
        again = httpx.post(rig.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2},
                           headers=good, timeout=30)  # fmt: skip
        assert again.status_code == 200
        assert "/props" not in rig.fake.calls, "a key the upstream took is not asked about again"


def test_prompts_over_the_token_limit_are_refused_before_any_copy(tmp_path: Path) -> None:
    for rig in make_rig(tmp_path, max_prompt_tokens=60):
        r = httpx.post(rig.url + "/completion", json={"prompt": list(range(2, 63)), "n_predict": 2})
        assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error", r.text
        assert "61 tokens" in r.json()["error"]["message"]
        assert httpx.post(rig.url + "/completion", json={"prompt": "w " * 100, "n_predict": 2}).status_code == 400
        assert httpx.post(rig.url + "/completion", json={"prompt": "w " * 10_000, "n_predict": 2}).status_code == 400
        with pytest.raises(openai.BadRequestError):
            chat(rig, [{"role": "user", "content": "w " * 100}])
        assert rig.fake.records == [] and rig.files() == []
        assert httpx.post(rig.url + "/completion", json={"prompt": "w " * 50, "n_predict": 2}).status_code == 200
        rig.idle()
        rig.restart_proxy()  # no limit set: the upstream's context size
        rig.fake.n_ctx = 80
        r = httpx.post(rig.url + "/completion", json={"prompt": list(range(2, 83)), "n_predict": 2})
        assert r.status_code == 400 and "81 tokens" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("mode", ["api-key", "header:X-Tenant"])
def test_with_tenant_isolation_no_request_reuses_another_tenants_prefix(tmp_path: Path, mode: str) -> None:
    for rig in make_rig(tmp_path, slots=1, tenant=mode):  # type: ignore[arg-type]

        def ask(who: str, messages: list[dict], rig: Rig = rig) -> str:
            key, extra = (who, {}) if mode == "api-key" else ("none", {"X-Tenant": who})
            client = openai.OpenAI(base_url=rig.url + "/v1", api_key=key, max_retries=0, default_headers=extra)
            out = client.chat.completions.create(model="fake", messages=messages, max_tokens=6)  # type: ignore[arg-type]
            rig.idle()
            return out.choices[0].message.content or ""

        secret = [*conversation("A"), {"role": "user", "content": "the secret word is swordfish"}]
        answer = ask("alice", secret)
        alice_file = rig.files()
        # Bob sends alice's very prompt, on the slot that holds it: nothing of it may come from alice.
        guess = [*conversation("A"), {"role": "user", "content": "the secret word is swordfish"}]
        ask("bob", guess)
        assert rig.fake.records[-1].cache_n == 0, rig.fake.records[-1]
        assert not [a for a in rig.fake.actions if a[0] == "restore"]
        assert len(rig.files()) == 2 and set(alice_file) < set(rig.files())
        m = rig.metrics()
        assert m["kvcfs_proxy_prompt_tokens_total[('source', 'restored')]"] == 0
        assert m["kvcfs_proxy_prompt_tokens_total[('source', 'in_slot')]"] == 0
        # Alice goes on: her own snapshot comes back into the slot bob used.
        ask("alice", [*secret, {"role": "assistant", "content": answer}, {"role": "user", "content": "more"}])
        assert ("restore", 0, alice_file[0]) in rig.fake.actions
        assert rig.fake.records[-1].cache_n > len(SYSTEM.split())
        # If the slot cannot be erased, the request goes with cache_prompt false: still nothing reused.
        rig.fake.fail_erases = True
        ask("carol", guess)
        assert rig.fake.records[-1].cache_n == 0 and rig.metrics()["kvcfs_proxy_errors_total[('step', 'erase')]"] == 1
        rig.fake.fail_erases = False
        assert len(rig.files()) == 3  # alice's (her second turn replaced it), bob's, carol's
        # Nor can a client restore (or save, or list) slots by hand through the proxy.
        by_hand = httpx.post(rig.url + "/slots/0", params={"action": "restore"}, json={"filename": alice_file[0]})
        assert by_hand.status_code == 403 and httpx.get(rig.url + "/slots").status_code == 403
        # Without a key (or header), a request restores nothing and saves nothing.
        files = rig.files()
        r = httpx.post(rig.url + "/v1/chat/completions", json={"messages": secret, "max_tokens": 2}, timeout=30)
        rig.idle()
        assert r.status_code == 200 and rig.fake.records[-1].cache_n == 0 and rig.files() == files
        tag = hashlib.sha256(b"/models/fake.gguf").hexdigest()[:8]
        assert all(re.fullmatch(rf"kvp-{tag}-[0-9a-f]{{8}}\.[0-9a-f]{{12}}-[0-9a-f]{{16}}", f) for f in files), files


def test_cache_prompt_false_runs_uncached(rig: Rig) -> None:
    body = {"prompt": SYSTEM + "no cache", "n_predict": 3, "cache_prompt": False}
    assert httpx.post(rig.url + "/completion", json=body, timeout=30).status_code == 200
    rig.idle()
    assert rig.files() == [] and rig.fake.records[-1].id_slot is not None
    assert rig.metrics()["kvcfs_proxy_requests_total[('outcome', 'uncached')]"] == 1


# -- streaming and disconnects -------------------------------------------------------------------


def test_client_gone_mid_stream_leaves_slot_and_store_consistent(tmp_path: Path) -> None:
    for rig in make_rig(tmp_path, slots=1, delay=0.05):
        messages = [*conversation("A"), {"role": "user", "content": "long answer please"}]
        body = {"model": "fake", "messages": messages, "max_tokens": 40, "stream": True}
        with httpx.stream("POST", rig.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for _ in r.iter_raw():
                break  # the client goes away after the first chunk
        rig.idle()
        assert len(rig.files()) == 1  # saved what the slot held, renamed into place
        # The store is consistent: the next request restores it (the fake checks every row).
        rig.fake.restart()
        answer = chat(rig, messages)
        rig.idle()
        assert answer == direct_chat(rig, messages)
        assert [a[0] for a in rig.fake.actions].count("restore") == 1
        assert rig.fake.records[-1].cache_n >= len(SYSTEM.split())


def test_streamed_chat_through_openai_equals_direct(rig: Rig) -> None:
    messages = [*conversation("S"), {"role": "user", "content": "stream it"}]
    assert chat(rig, messages, stream=True) == direct_chat(rig, messages)
    rig.idle()
    assert len(rig.files()) == 1
    m = rig.metrics()
    assert m["kvcfs_proxy_time_to_first_token_seconds_count[('restore', 'no')]"] >= 1
    assert m["kvcfs_proxy_save_seconds_count[]"] >= 1


# -- budget and the daemon's lookup ----------------------------------------------------------------


def test_budget_deletes_lowest_score_snapshots(tmp_path: Path) -> None:
    for rig in make_rig(tmp_path, cache_max_bytes=1):  # every save passes it
        for name in "ABC":
            turn(rig, conversation(name), f"{name} hi")
        rig.idle()
        m = rig.metrics()
        assert m["kvcfs_proxy_evicted_snapshots_total[]"] >= 2
        assert len(rig.files()) <= 1


def test_budget_touches_only_this_proxys_own_snapshots(tmp_path: Path) -> None:
    from fake_llama import state_file, tokenize

    for rig in make_rig(tmp_path, cache_max_bytes=1):
        tokens = tokenize(SYSTEM + " another model's conversation", True)
        other_model = rig.mount.mnt / "kvp-00000000-0123456789abcdef"  # what a proxy for another model saves
        other_model.write_bytes(state_file(tokens))
        os.setxattr(other_model, LABEL_XATTR, str(len(tokens)).encode())
        tag = hashlib.sha256(b"/models/fake.gguf").hexdigest()[:8]  # the fake's model: this proxy's names
        users = {"kvp-notes.txt": b"my notes", f"kvp-{tag}-mine": b"named like ours, not ours"}
        for name, data in users.items():
            (rig.mount.mnt / name).write_bytes(data)
        for name in "ABC":
            turn(rig, conversation(name), f"{name} hi")
        rig.idle()
        assert rig.metrics()["kvcfs_proxy_evicted_snapshots_total[]"] >= 2
        assert other_model.exists()
        assert all((rig.mount.mnt / name).read_bytes() == data for name, data in users.items())
        assert len([f for f in rig.files() if f not in users and f != other_model.name]) <= 1


def test_prefix_match_endpoint(rig: Rig) -> None:
    turn(rig, conversation("A"), "hello")
    daemon = httpx.Client(transport=httpx.HTTPTransport(uds=str(rig.mount.store / "api.sock")), base_url="http://d")
    name = rig.files()[0]
    tokens = rig.proxy.pool.slots[0].tokens  # type: ignore[union-attr]
    r = daemon.post("/prefix-match", json={"tokens": tokens[:50] + [7, 7], "prefix": "kvp-", "limit": 5}).json()
    assert r["matches"][0]["path"] == name and r["matches"][0]["match"] == 50
    assert daemon.post("/prefix-match", json={"tokens": tokens, "prefix": "zzz"}).json()["count"] == 0
    assert daemon.post("/prefix-match", json={"tokens": [], "exclude_suffix": name[-3:]}).json()["count"] == 0
    for bad in ({"tokens": "x"}, {"tokens": [1.5]}, {"tokens": [1 << 40]}, {"tokens": [], "limit": 0},
                {"tokens": [], "what": 1}, [1, 2]):  # fmt: skip
        r2 = daemon.post("/prefix-match", json=bad)
        assert r2.status_code == 400 and "error" in r2.json(), bad
    assert daemon.post("/prefix-match", content=b"{").status_code == 400


# -- what the proxy reports ------------------------------------------------------------------------

LINE = re.compile(r"POST /v1/chat/completions, slot \d: (\d+) prompt tokens: (0 restored|(\d+) restored \(\d+ loaded "
                  r"from (\S+)\)), (\d+) already in the slot, (\d+) evaluated; (.*)")  # fmt: skip


def request_lines(caplog: pytest.LogCaptureFixture) -> list[re.Match[str]]:
    out = []
    for record in caplog.records:
        if record.name == "kvchunkfs.proxy.server" and record.levelno == logging.INFO:
            m = LINE.fullmatch(record.getMessage())
            if m is not None:
                out.append(m)
    return out


def test_each_request_logs_what_it_restored_evaluated_and_saved(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvchunkfs.proxy.server")
    a1 = turn(rig, conversation("A"), "one")
    rig.fake.restart()  # empty slots: the next turn comes from the store
    turn(rig, a1, "two")
    first, second = request_lines(caplog)
    name = rig.files()[0]
    assert first.group(2) == "0 restored" and first.group(5) == "0"
    # A new conversation: every token evaluated but the first (the proxy's probe of the server's KV layout)
    assert int(first.group(6)) >= int(first.group(1)) - 1
    assert re.fullmatch(rf"saved \d+ tokens as {re.escape(name)} in \d+ ms", first.group(7)), first.group(7)
    assert second.group(4) == name and int(second.group(3)) > len(SYSTEM.split())
    assert int(second.group(6)) < 20, "only the new turn evaluated"
    assert second.group(7).startswith("saved ") and second.group(7).split()[4] == name

    body = {"prompt": SYSTEM + "no cache", "n_predict": 3, "cache_prompt": False}
    assert httpx.post(rig.url + "/completion", json=body, timeout=30).status_code == 200
    rig.idle()
    assert any(
        r.getMessage().startswith("POST /completion, slot ")
        and r.getMessage().endswith("uncached; not saved: the client asked for no prompt cache")
        for r in caplog.records
    ), caplog.text

    caplog.clear()
    rig.mount.stop()  # saves are skipped now: one warning, and each request's line says so
    for user in ("three", "four"):
        a1 = turn(rig, a1, user)
    lines = request_lines(caplog)
    assert len(lines) == 2 and all(m.group(7).startswith("not saved: ") for m in lines), caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "saves are skipped until" in w]) == 1, warnings
    rig.mount.start()
    turn(rig, a1, "five")
    assert request_lines(caplog)[-1].group(7).startswith("saved ")
    assert any("is a kv-chunk-fs mount again" in r.getMessage() for r in caplog.records)


def test_the_proxy_says_at_start_what_its_mount_is(rig: Rig, tmp_path: Path) -> None:
    found = check_mount(rig.mount.mnt, rig.mount.store)
    assert found.mounted and found.level == logging.INFO
    assert found.line == f"{rig.mount.mnt} is a kv-chunk-fs mount with 0 snapshots"
    turn(rig, conversation("A"), "one")
    assert check_mount(rig.mount.mnt, rig.mount.store).line.endswith("with 1 snapshot")
    elsewhere = check_mount(rig.mount.mnt, tmp_path / "not-the-store")
    assert elsewhere.mounted and elsewhere.level == logging.WARNING and "no daemon answers" in elsewhere.line
    plain = check_mount(tmp_path, rig.mount.store)
    assert not plain.mounted and plain.level == logging.WARNING
    assert "saves are skipped until" in plain.line and "not a kv-chunk-fs mount" in plain.line
    from kvchunkfs.cli.main import main

    assert main(["proxy", "--mount", str(tmp_path / "missing"), "--upstream", rig.upstream.url]) == 2


# -- the command ---------------------------------------------------------------------------------


def test_cli_proxy_serves_and_saves_before_it_exits(rig: Rig) -> None:
    import subprocess
    import sys

    from conftest import SRC

    from kvchunkfs.cli.main import main

    assert main(["proxy", "--upstream", rig.upstream.url]) == 2  # no --mount: a clear error
    port = free_port()
    # The README's command: no --store (the mount table names the mount's store)
    argv = [sys.executable, "-m", "kvchunkfs.cli", "proxy", "--mount", str(rig.mount.mnt), "--upstream",
            rig.upstream.url, "--listen", f"127.0.0.1:{port}"]  # fmt: skip
    proc = subprocess.Popen(argv, env=dict(os.environ, PYTHONPATH=str(SRC)), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "proxy did not start"
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        messages = [*conversation("CLI"), {"role": "user", "content": "hi"}]
        out = client.chat.completions.create(model="fake", messages=messages, max_tokens=6)  # type: ignore[arg-type]
        assert out.choices[0].message.content == direct_chat(rig, messages)
        deadline = time.monotonic() + 30
        while not rig.files() or rig.files()[0].endswith(".tmp"):
            assert time.monotonic() < deadline, "not saved"
            time.sleep(0.05)
        rig.fake.restart()  # the next turn comes from the store
        more = [*messages, {"role": "assistant", "content": out.choices[0].message.content},
                {"role": "user", "content": "more"}]  # fmt: skip
        client.chat.completions.create(model="fake", messages=more, max_tokens=6)  # type: ignore[arg-type]
        assert [a[0] for a in rig.fake.actions][:2] == ["save", "restore"], rig.fake.actions
        assert rig.fake.records[-1].cache_n > len(SYSTEM.split())
    finally:
        proc.terminate()  # SIGTERM: uvicorn stops, the lifespan waits for the save in flight
        _, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, -15), err.decode()  # uvicorn re-raises SIGTERM after its graceful shutdown
    assert b"Traceback" not in err, err.decode()
    assert f"{rig.mount.mnt} is a kv-chunk-fs mount with 0 snapshots" in err.decode(), err.decode()
    assert "prompt tokens: 0 restored" in err.decode(), "a line per request at the default level"
    assert len(rig.files()) == 1 and not rig.files()[0].endswith(".tmp")


# -- compatibility, refusals, slot choice, the mount -------------------------------------------------


def restores_of(rig: Rig, name: str | None = None) -> list[tuple[str, int, str]]:
    return [a for a in rig.fake.actions if a[0] == "restore" and (name is None or a[2] == name)]


def test_a_server_reconfigured_with_other_kv_types_keeps_each_configurations_snapshots(tmp_path: Path) -> None:
    from fake_llama import F16, Q4_0

    for rig in make_rig(tmp_path, slots=1):
        a1 = turn(rig, conversation("A"), "one")
        f16_files = rig.files()
        f16_bytes = (rig.mount.mnt / f16_files[0]).read_bytes()
        # llama-server restarted with -ctk/-ctv q4_0: nothing saved with f16 is sent to it
        rig.fake.kv_type = Q4_0
        rig.fake.restart()
        a2 = turn(rig, a1, "two")
        assert restores_of(rig) == [], "an f16 snapshot offered to a q4_0 server"
        assert rig.fake.records[-1].prompt_n <= len(tokens_of(a2[:-1]))  # no slower than without the proxy
        q4_files = [f for f in rig.files() if f not in f16_files]
        assert len(q4_files) == 1 and (rig.mount.mnt / f16_files[0]).read_bytes() == f16_bytes  # saved beside it
        assert "q4_0" not in q4_files[0] and q4_files[0].split("-")[2] != f16_files[0].split("-")[2]
        assert os.getxattr(rig.mount.mnt / q4_files[0], "user.kvcfs.label.kv_layout") != os.getxattr(
            rig.mount.mnt / f16_files[0], "user.kvcfs.label.kv_layout")  # fmt: skip
        turn(rig, a2, "three")  # q4_0's own conversation goes on in its own set
        # Back to f16: the f16 snapshot is found again and restored.
        rig.fake.kv_type = F16
        rig.fake.restart()
        turn(rig, a1, "two, asked again")
        assert restores_of(rig) == [("restore", 0, f16_files[0])]
        assert rig.fake.records[-1].cache_n >= len(tokens_of(a1[:-1])) - 1
        assert rig.metrics().get("kvcfs_proxy_refused_restores_total[('reason', 'refused')]", 0) == 0


def tokens_of(messages: list[dict]) -> list[int]:
    from fake_llama import template, tokenize

    return tokenize(template(messages), True)


def damage(path: Path) -> None:
    """Change bytes inside a snapshot's KV rows (its tokens stay): llama-server refuses it."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        f.write(b"\xff" * 50)


def test_a_refused_restore_keeps_the_slots_prefix_and_is_not_offered_again(tmp_path: Path) -> None:
    for rig in make_rig(tmp_path, slots=1):
        b1 = turn(rig, conversation("B"), "one")
        a1 = turn(rig, conversation("A"), "one")  # the slot held B: the shared system prompt is reused
        a_file = [f for f in rig.files() if (rig.mount.mnt / f).stat().st_mtime_ns == max(
            (rig.mount.mnt / g).stat().st_mtime_ns for g in rig.files())][0]  # fmt: skip
        damage(rig.mount.mnt / a_file)
        turn(rig, b1, "two")  # B comes back into the slot
        from kvchunkfs.service.prefixtree import common_prefix_len

        shared = common_prefix_len(tokens_of(a1), tokens_of(b1))  # the system prompt
        assert shared >= len(SYSTEM.split())
        a2 = [*a1, {"role": "user", "content": "two"}]
        turn(rig, a1, "two")  # A's snapshot is refused: the shared prefix comes back, not a full prefill
        assert restores_of(rig, a_file) != []
        assert rig.fake.records[-1].cache_n >= shared - 1, rig.fake.records[-1]
        assert rig.fake.records[-1].prompt_n <= len(tokens_of(a2)) - shared + 1
        assert rig.metrics()["kvcfs_proxy_refused_restores_total[('reason', 'refused')]"] == 1
        turn(rig, b1, "three")
        turn(rig, a1, "two, edited")  # the refused file as it is is not offered again
        assert len(restores_of(rig, a_file)) == 1


def test_conversations_sharing_a_system_prompt_each_keep_a_slot(tmp_path: Path) -> None:
    for rig in make_rig(tmp_path, slots=2):
        convs = {name: conversation(name) for name in "AB"}
        slots: dict[str, set[int | None]] = {"A": set(), "B": set()}
        for round_ in range(3):
            for name in "AB":
                convs[name] = turn(rig, convs[name], f"{name} round {round_}")
                slots[name].add(rig.fake.records[-1].id_slot)
        assert len(slots["A"]) == 1 and len(slots["B"]) == 1 and slots["A"] != slots["B"], slots
        assert len(restores_of(rig)) <= 1  # at most B's first turn takes the shared prompt from the store
        assert all(r.prompt_n < 40 for r in rig.fake.records[2:]), rig.fake.records


def test_health_is_degraded_while_saves_fail(rig: Rig) -> None:
    turn(rig, conversation("A"), "one")
    assert httpx.get(rig.url + "/health").json() == {"status": "ok"}
    rig.fake.save_fails = True
    turn(rig, conversation("B"), "one")
    health = httpx.get(rig.url + "/health").json()
    assert health["status"] == "degraded" and "save" in health["reason"], health
    assert not [f for f in rig.files() if f.endswith(".tmp")]  # the failed save left no file
    rig.fake.save_fails = False
    turn(rig, conversation("C"), "one")
    assert httpx.get(rig.url + "/health").json() == {"status": "ok"}


def run_cli_proxy(rig: Rig, mount: Path, *extra: str) -> subprocess.CompletedProcess[bytes]:
    import sys

    from conftest import SRC

    argv = [sys.executable, "-m", "kvchunkfs.cli", "proxy", "--mount", str(mount), "--upstream", rig.upstream.url,
            "--listen", f"127.0.0.1:{free_port()}", *extra]  # fmt: skip
    return subprocess.run(argv, env=dict(os.environ, PYTHONPATH=str(SRC)), capture_output=True, timeout=30)


def test_a_wrong_mount_is_refused_with_one_line(tmp_path: Path) -> None:
    for rig in make_rig(tmp_path):
        (tmp_path / "plain").mkdir()
        (rig.mount.mnt / "sub").mkdir()
        other = Mount(tmp_path / "store2", tmp_path / "mnt2", tmp_path / "daemon2.log")
        tmpfs = tmp_path / "tmpfs"
        tmpfs.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tmpfs)], check=True)
        other.start()
        try:
            cases = {tmp_path / "plain": "plain directory",
                     rig.mount.mnt / "sub": f"inside the kv-chunk-fs mount at {rig.mount.mnt}",
                     tmpfs: "tmpfs mount", other.mnt: "--slot-save-path",
                     tmp_path / "missing": "No such file"}  # fmt: skip
            for mount, why in cases.items():
                done = run_cli_proxy(rig, mount)
                err = done.stderr.decode()
                assert done.returncode == 2 and why in err, (mount, err)
                assert len([line for line in err.splitlines() if line.startswith("kv-chunk-fs")]) == 1, err
                assert "Traceback" not in err, err
            assert os.listdir(other.mnt) == []
        finally:
            other.stop()
            subprocess.run(["umount", "-l", str(tmpfs)], check=False)


def test_commands_take_the_mountpoint_as_store(rig: Rig) -> None:
    import sys

    from conftest import SRC

    turn(rig, conversation("A"), "one")
    argv = [sys.executable, "-m", "kvchunkfs.cli", "ls", "--json", "--store", str(rig.mount.mnt)]
    done = subprocess.run(argv, env=dict(os.environ, PYTHONPATH=str(SRC)), capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert [row["path"] for row in json.loads(done.stdout)] == rig.files()
