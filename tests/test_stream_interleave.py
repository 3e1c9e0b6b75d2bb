"""The streaming writer under every interleaving of client writes and its chunker worker.

``Scheduler`` parks the worker at each of its steps (``FileContent.hook``) and lets the test decide
when it moves, so an interleaving is chosen by the test, not by the machine's load: a failure
reproduces from its seed every time. An append that lost its last bytes when the worker
lagged behind a short write that followed an unaligned one is the first case below.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from helpers import rand_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchunkfs.file.content import Action, FileContent
from kvchunkfs.file.files import Files
from kvchunkfs.file.queues import ByteQueue
from kvchunkfs.format.chunker import BATCH
from kvchunkfs.store.repository import Repository, StoreSettings

MiB = 1 << 20
PARKING = ("ready", "taken", "stored")  # steps the worker waits at until the test lets it go


# -- ByteQueue ---------------------------------------------------------------------------------


def test_take_keeps_bytes_spread_over_several_pieces():
    q = ByteQueue()
    for piece in (b"A" * 100, b"xyz", b"0123456789a"):
        q.append(piece)
    taken = b"".join(q.take(keep=14))
    assert taken == b"A" * 100
    assert q.join() == b"xyz0123456789a" and len(q) == 14


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=40), max_size=8), st.integers(0, 400))
def test_take_splits_exactly(pieces, keep):
    q = ByteQueue()
    for p in pieces:
        q.append(p)
    whole = b"".join(pieces)
    keep = min(keep, len(whole))
    taken = b"".join(q.take(keep=keep))
    assert taken + q.join() == whole
    assert len(q) == keep == len(q.join())


# -- a scheduler for the worker ----------------------------------------------------------------


class Scheduler:
    """Parks the chunker worker at each step until ``step()``; ``free`` lets it run on its own."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.point: str | None = None  # where the worker is parked, or "idle"
        self.tokens = 0
        self.free = False
        self.steps = 0

    def __call__(self, point: str) -> None:  # on the worker thread
        with self.cv:
            self.point = point
            self.cv.notify_all()
            if point in ("idle", "exit"):
                return  # it now waits on the content's condition for bytes, or ends
            self.cv.wait_for(lambda: self.free or self.tokens > 0)
            if not self.free:
                self.tokens -= 1
            self.point = None

    def parked(self) -> bool:
        with self.cv:
            return self.point in PARKING

    def step(self) -> None:
        """Let the parked worker run to its next stop (another step, or idle)."""
        with self.cv:
            assert self.point in PARKING
            self.tokens += 1
            self.point = None
            self.cv.notify_all()
            assert self.cv.wait_for(lambda: self.point is not None, timeout=30), "worker did not stop again"
            self.steps += 1

    def settle(self, content: FileContent) -> None:
        """After a client call: wait until the worker has noticed any work it made ready."""
        with content.cond:
            ready = content._active and content._work_ready() and not content._stop
        if ready:
            with self.cv:
                assert self.cv.wait_for(lambda: self.point in PARKING, timeout=30), "worker did not wake"

    def run_free(self) -> None:
        with self.cv:
            self.free = True
            self.cv.notify_all()

    def hold(self) -> None:
        with self.cv:
            self.free = False


def new_content(tmp: Path, keep_partial_page: bool) -> tuple[Files, FileContent, Scheduler]:
    repo = Repository(tmp, StoreSettings(writeback_cache=keep_partial_page))
    files = Files(repo)
    content = files.content(repo.empty_index())
    sched = Scheduler()
    content.hook = sched
    return files, content, sched


def client_write(content: FileContent, off: int, data: bytes, sched: Scheduler) -> None:
    """What fsops.write does, with the worker held wherever the scheduler holds it."""
    while True:
        action = content.plan_write(off, len(data))
        if action is Action.START_STREAM:
            content.start_stream()
        elif action is Action.TO_STAGING:
            sched.run_free()  # a staging copy stops the worker; let it run to its end
            content.to_staging()
            content.wait_worker()
            sched.hold()
        elif content.write(off, data):
            break
        sched.settle(content)
    sched.settle(content)


def commit(files: Files, content: FileContent, sched: Scheduler) -> bytes:
    sched.run_free()
    try:
        index, gen = content.prepare_commit()
    finally:
        sched.hold()
    content.committed(gen)
    return files.read_file(index, 0, index.size)


@pytest.mark.parametrize("keep_partial_page", [True, False])
def test_lagging_worker_after_short_unaligned_writes(tmp_path, keep_partial_page):
    """The lost-append case, deterministically: the worker wakes only after a short write that followed an
    unaligned one, with a full batch queued (before the fix, 3 bytes were lost here)."""
    files, content, sched = new_content(tmp_path / "s", keep_partial_page)
    want = bytearray()
    try:
        for piece in (rand_bytes(BATCH, 1), b"abc", b"0123456789a"):  # end % 4096: 0, then 3, then 14
            client_write(content, len(want), piece, sched)
            want += piece
        assert sched.parked()  # the worker saw the batch but has not taken it yet
        sched.step()  # take (keeping the partial page in writeback mode)
        sched.step()  # cut and store
        sched.step()  # apply
        assert content.read(0, len(want) + 5, files.read_chunks) == want
        assert commit(files, content, sched) == want
    finally:
        content.close()
        files.close()
        files.repo.close()


# -- every interleaving: a model test ----------------------------------------------------------

client_ops = st.one_of(
    st.tuples(st.just("append"), st.sampled_from([1, 3, 11, 4095, 4097, 65536, MiB, 3 * MiB + 7])),
    st.tuples(st.just("append_big"), st.sampled_from([BATCH, BATCH - 4096, BATCH + 4095])),
    st.tuples(st.just("rewrite_end"), st.integers(1, 9000), st.integers(1, 9000)),  # back n bytes, write m
    st.tuples(st.just("truncate0")),
    st.tuples(st.just("read")),
    st.tuples(st.just("commit")),
)
steps = st.lists(st.one_of(client_ops, st.tuples(st.just("worker"), st.integers(1, 4))), min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(steps, st.booleans(), st.integers(0, 10_000))
def test_any_interleaving_matches_a_plain_buffer(tmp_path_factory, script, keep_partial_page, seed):
    run_script(tmp_path_factory.mktemp("store"), script, keep_partial_page, seed)


def run_script(store: Path, script: list[tuple], keep_partial_page: bool, seed: int) -> None:
    """Run client calls and worker steps in the given order; the content must equal a bytearray."""
    files, content, sched = new_content(store, keep_partial_page)
    model = bytearray()
    try:
        for n, op in enumerate(script):
            data_seed = seed * 100 + n
            if op[0] == "worker":
                for _ in range(op[1]):
                    if not sched.parked():
                        break
                    sched.step()
            elif op[0] in ("append", "append_big"):
                data = rand_bytes(op[1], data_seed)
                client_write(content, len(model), data, sched)
                model += data
            elif op[0] == "rewrite_end":
                off = max(0, len(model) - op[1])
                data = rand_bytes(op[2], data_seed)
                client_write(content, off, data, sched)
                model[off : off + len(data)] = data
            elif op[0] == "truncate0":
                assert content.truncate(0) is Action.DIRECT
                sched.settle(content)
                del model[:]
            elif op[0] == "read":
                assert content.read(0, len(model) + 10, files.read_chunks) == model
            else:
                assert commit(files, content, sched) == model, f"step {n} of {script}"
            assert content.size == len(model)
        assert content.read(0, len(model) + 10, files.read_chunks) == model, script
        assert commit(files, content, sched) == model, script
    finally:
        sched.run_free()
        content.close()
        files.close()
        files.repo.close()


# -- exhaustive: every placement of worker steps around a fixed client sequence -----------------

SEQUENCES = {
    # the issue-14 shape: a batch, unaligned short writes, a commit, an append-mode continuation
    "append_after_unaligned": [
        ("append", BATCH),
        ("append", 3),
        ("append", 11),
        ("commit",),
        ("append", 4097),
        ("append", 1),
    ],
    # the kernel rewriting the last partial page (writeback cache), around a batch boundary
    "rewrite_partial_page": [
        ("append", BATCH + 100),
        ("rewrite_end", 100, 4096),
        ("append", 5),
        ("rewrite_end", 4101, 4101),
    ],
}


@pytest.mark.parametrize("name", sorted(SEQUENCES))
@pytest.mark.parametrize("keep_partial_page", [True, False])
def test_every_worker_placement(tmp_path_factory, name, keep_partial_page):
    import itertools

    seq = SEQUENCES[name]
    runs = 0
    for placement in itertools.product((0, 1, 3), repeat=len(seq)):
        script: list[tuple] = []
        for op, worker_steps in zip(seq, placement, strict=True):
            script.append(op)
            if worker_steps:
                script.append(("worker", worker_steps))
        run_script(tmp_path_factory.mktemp("store"), script, keep_partial_page, seed=runs)
        runs += 1
    assert runs == 3 ** len(seq)
